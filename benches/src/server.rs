//! `rpc-bench server`: one benchmark server process (started by `rpc-bench serve`), for one
//! system. It prints `READY <port>`, then answers `CPU` and `QUIT` on its standard input.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use rpc_core::verbs::ProviderKind;

use crate::control;
use crate::service::{BenchService, TonicBenchService};
use crate::tonic_client::{Flavor, MAX_MESSAGE, Window};

/// Which server to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ServerKind {
    /// rdma-rpc.
    Rpc,
    /// tonic (gRPC).
    Tonic,
    /// The raw provider echo.
    Raw,
}

/// Arguments of `rpc-bench server`.
#[derive(Clone, Debug, clap::Args)]
pub struct ServerArgs {
    /// Which server.
    #[arg(long, value_enum)]
    pub system: ServerKind,
    /// Address to bind (port 0: any).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub bind: String,
    /// Pin the whole process to this core.
    #[arg(long)]
    pub core: Option<usize>,
    /// RDMA provider (rpc, raw).
    #[arg(long, default_value = "soft")]
    pub provider: String,
    /// rdma-rpc shard poll mode.
    #[arg(long, value_enum, default_value = "busy")]
    pub poll: PollArg,
    /// tonic's runtime.
    #[arg(long, value_enum, default_value = "ct")]
    pub runtime: Flavor,
    /// tonic: initial HTTP/2 stream and connection window in bytes (0: tonic's default).
    #[arg(long, default_value_t = 0)]
    pub window: u32,
    /// tonic: adaptive (BDP) HTTP/2 windows.
    #[arg(long)]
    pub adaptive_window: bool,
    /// tonic: serve the rdma-rpc implementation through the generated adapter instead of the
    /// native tonic one.
    #[arg(long)]
    pub adapter: bool,
    /// raw: largest message.
    #[arg(long, default_value_t = 16 << 20)]
    pub max_size: usize,
    /// rdma-rpc: the server as `Server::builder()` makes it (one shard, its poll mode and
    /// limits), only the service and the provider given: `--poll`, the harness's message
    /// limit and shard pinning are not applied.
    #[arg(long)]
    pub builder_defaults: bool,
    /// rdma-rpc: `ServerBuilder::max_connections_per_shard` (default: the builder's).
    #[arg(long)]
    pub max_connections: Option<u32>,
    /// Exit after this many seconds whatever happens.
    #[arg(long, default_value_t = 600)]
    pub max_secs: u64,
    /// Exit when the parent process dies.
    #[arg(long)]
    pub die_with_parent: bool,
}

/// rdma-rpc's poll modes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PollArg {
    /// Spin forever.
    Busy,
    /// Spin, yield, sleep.
    Adaptive,
    /// Sleep on the completion channel.
    Event,
}

impl From<PollArg> for rpc_core::ShardPolling {
    fn from(p: PollArg) -> Self {
        match p {
            PollArg::Busy => rpc_core::ShardPolling::Busy,
            PollArg::Adaptive => rpc_core::ShardPolling::Adaptive,
            PollArg::Event => rpc_core::ShardPolling::Event,
        }
    }
}

/// Runs the server process until `QUIT`, the end of its input, or `--max-secs`.
///
/// # Errors
/// When the server cannot start.
pub fn run(args: &ServerArgs) -> Result<()> {
    if args.die_with_parent && !crate::sys::die_with_parent() {
        bail!("parent process already gone");
    }
    control::watchdog(Duration::from_secs(args.max_secs), "server");
    if let Some(c) = args.core
        && !crate::sys::pin_current_thread(&[c])
    {
        eprintln!("rpc-bench server: could not pin to core {c}; running unpinned");
    }
    let provider: ProviderKind = args.provider.parse()?;
    // Everything the server needs stays alive until the process exits.
    let (port, _keep) = match args.system {
        ServerKind::Rpc => start_rpc(args, provider)?,
        ServerKind::Tonic => start_tonic(args)?,
        ServerKind::Raw => (
            crate::raw::start_server(provider, &args.bind, args.max_size)?,
            Keep::None,
        ),
    };
    let mut out = std::io::stdout().lock();
    writeln!(out, "READY {port}")?;
    out.flush()?;
    for line in std::io::stdin().lock().lines() {
        match line?.trim() {
            "CPU" => writeln!(
                out,
                "{}",
                control::format_cpu(crate::sys::process_cpu(), crate::sys::nic_counters())
            )?,
            "QUIT" => break,
            other => writeln!(out, "ERR unknown command {other:?}")?,
        }
        out.flush()?;
    }
    // Exit at once: no graceful shutdown to wait for, and nothing of ours outlives the process
    // (the soft provider's memory is memfd, freed with it).
    std::process::exit(0)
}

/// What keeps a server alive.
#[allow(dead_code)] // held, never read
enum Keep {
    None,
    Rpc(tokio::runtime::Runtime, rpc_core::RunningServer),
    Thread(std::thread::JoinHandle<()>),
}

fn start_rpc(args: &ServerArgs, provider: ProviderKind) -> Result<(u16, Keep)> {
    // The acceptor only: idle once the client is connected.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut b = rpc_core::Server::builder()
        .add_service(crate::proto::bench_server::BenchServer::new(BenchService))
        .provider(provider);
    if !args.builder_defaults {
        b = b
            .shards(1)
            .poll_mode(args.poll.into())
            .max_message(MAX_MESSAGE as u64);
        if let Some(c) = args.core {
            b = b.pin_cores(vec![c]);
        }
    }
    if let Some(n) = args.max_connections {
        b = b.max_connections_per_shard(n);
    }
    let server = rt
        .block_on(b.bind(&args.bind))
        .context("rdma-rpc: start the server")?;
    let port = server.local_addr().port();
    Ok((port, Keep::Rpc(rt, server)))
}

/// Accepted TCP connections with TCP_NODELAY set (tonic ignores its own `tcp_nodelay` when
/// serving an incoming stream).
struct NoDelay(tokio::net::TcpListener);

impl futures_core::Stream for NoDelay {
    type Item = std::io::Result<tokio::net::TcpStream>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        match self.0.poll_accept(cx) {
            Poll::Ready(Ok((s, _))) => Poll::Ready(Some(s.set_nodelay(true).map(|()| s))),
            Poll::Ready(Err(e)) => Poll::Ready(Some(Err(e))),
            Poll::Pending => Poll::Pending,
        }
    }
}

fn start_tonic(args: &ServerArgs) -> Result<(u16, Keep)> {
    let flavor = args.runtime;
    let window = Window {
        initial: (args.window > 0).then_some(args.window),
        adaptive: args.adaptive_window,
    };
    let adapter = args.adapter;
    let bind: SocketAddr = args.bind.parse().context("tonic: --bind must be IP:PORT")?;
    let std_listener = std::net::TcpListener::bind(bind)?;
    std_listener.set_nonblocking(true)?;
    let port = std_listener.local_addr()?.port();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
    let thread = std::thread::Builder::new()
        .name("tonic-server".into())
        .spawn(move || {
            let rt = match crate::tonic_client::runtime(flavor) {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            let r = rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(std_listener)?;
                let mut server = tonic::transport::Server::builder();
                if let Some(w) = window.initial {
                    server = server
                        .initial_stream_window_size(w)
                        .initial_connection_window_size(w);
                }
                if window.adaptive {
                    server = server.http2_adaptive_window(Some(true));
                }
                let _ = ready_tx.send(Ok(()));
                let incoming = NoDelay(listener);
                if adapter {
                    let svc = crate::proto::bench_tonic::BenchTonicAdapter::new(BenchService)
                        .into_service()
                        .max_decoding_message_size(MAX_MESSAGE)
                        .max_encoding_message_size(MAX_MESSAGE);
                    server
                        .add_service(svc)
                        .serve_with_incoming(incoming)
                        .await?;
                } else {
                    let svc = crate::proto::bench_tonic::bench_server::BenchServer::new(
                        TonicBenchService,
                    )
                    .max_decoding_message_size(MAX_MESSAGE)
                    .max_encoding_message_size(MAX_MESSAGE);
                    server
                        .add_service(svc)
                        .serve_with_incoming(incoming)
                        .await?;
                }
                Ok::<_, anyhow::Error>(())
            });
            if let Err(e) = r {
                eprintln!("rpc-bench tonic server: {e:#}");
            }
        })?;
    ready_rx
        .recv_timeout(Duration::from_secs(10))
        .context("tonic: server thread did not start")??;
    Ok((port, Keep::Thread(thread)))
}
