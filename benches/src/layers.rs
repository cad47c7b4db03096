//! `rpc-bench layers`: what the microservice layers cost a call (issue 15's speed targets).
//! 32 B blocking echoes, one outstanding, against servers in this process, in interleaved
//! rounds so that every configuration sees the same load:
//!
//! - `plain`: no layer;
//! - `interceptors`: an interceptor on the server's service and on the channel;
//! - `stats`: call statistics on the server and on the channel;
//! - `interceptors+stats`: both (the "interceptors and metrics enabled");
//! - `traced`: requests carrying a `traceparent` (the server parses it, opens a span and
//!   makes the context current while the handler runs);
//! - `balanced x3`: a balanced channel over three connections to the plain server (the
//!   picker, the load count and the replica bookkeeping on every call).
//!
//! The client thread polls its own completions (`ClientPoller::Caller`, blocking calls) and
//! each server has one shard, so two threads spin: one core each on a two-core machine.

use std::time::Instant;

use anyhow::{Context as _, Result};
use bytes::Bytes;
use hdrhistogram::Histogram;
use rpc_core::trace::TraceContext;
use rpc_core::{Channel, ClientPoller, Request, RunningServer, Server, Status};

use crate::proto::EchoRequest;
use crate::proto::bench_client::BenchBlockingClient;
use crate::proto::bench_server::BenchServer;
use crate::service::BenchService;

/// Arguments of `rpc-bench layers`.
#[derive(Debug, clap::Args)]
pub struct LayerArgs {
    /// Interleaved rounds (every configuration once per round).
    #[arg(long, default_value_t = 20)]
    rounds: usize,
    /// Calls per configuration and round.
    #[arg(long, default_value_t = 5000)]
    calls: usize,
    /// Write the figures as JSON here too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// One configuration's figures.
#[derive(Debug, serde::Serialize)]
struct Row {
    config: &'static str,
    calls: u64,
    p50_ns: u64,
    p99_ns: u64,
    /// p50 over the plain configuration's p50 in the same run.
    p50_ratio: f64,
}

/// A configuration: its client, and whether its requests carry a trace context.
struct Config {
    name: &'static str,
    client: BenchBlockingClient,
    traced: bool,
    hist: Histogram<u64>,
}

fn passthrough(req: Request<()>) -> Result<Request<()>, Status> {
    if req.metadata().get("authorization").is_some() {
        return Err(Status::unauthenticated("unexpected token"));
    }
    Ok(req)
}

async fn serve(interceptor: bool, stats: bool) -> Result<RunningServer> {
    let svc = if interceptor {
        Server::builder().add_service(BenchServer::with_interceptor(BenchService, passthrough))
    } else {
        Server::builder().add_service(BenchServer::new(BenchService))
    };
    svc.stats(stats)
        .bind("127.0.0.1:0")
        .await
        .context("bind a server")
}

async fn connect(server: &RunningServer) -> Result<Channel> {
    Channel::builder(server.local_addr().to_string())
        .poller(ClientPoller::Caller)
        .connect()
        .await
        .context("connect")
}

/// Runs the measurement and prints the table.
///
/// # Errors
/// When a server cannot start, a channel cannot connect or a call fails.
pub fn run(args: &LayerArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .context("runtime")?;
    let (servers, mut configs) = rt.block_on(async {
        let plain = serve(false, false).await?;
        let icpt = serve(true, false).await?;
        let stats = serve(false, true).await?;
        let both = serve(true, true).await?;
        let to_plain = connect(&plain).await?;
        let (balanced, balancer) = Channel::balance_channel();
        for i in 0..3 {
            balancer.insert(
                format!("replica-{i}"),
                Channel::builder(plain.local_addr().to_string()).poller(ClientPoller::Caller),
            );
        }
        let config = |name, ch: Channel, traced| Config {
            name,
            client: BenchBlockingClient::new(ch),
            traced,
            hist: crate::measure::histogram(),
        };
        let configs = vec![
            config("plain", to_plain.clone(), false),
            config(
                "interceptors",
                connect(&icpt).await?.with_interceptor(passthrough),
                false,
            ),
            config("stats", connect(&stats).await?.with_stats(), false),
            config(
                "interceptors+stats",
                connect(&both)
                    .await?
                    .with_interceptor(passthrough)
                    .with_stats(),
                false,
            ),
            config("traced", to_plain, true),
            config("balanced x3", balanced, false),
        ];
        anyhow::Ok(((plain, icpt, stats, both), configs))
    })?;
    let payload = Bytes::from(vec![0x5a; 32]);
    let root = TraceContext::new_root(true);
    let call = |c: &Config| -> Result<()> {
        let mut req = Request::new(EchoRequest {
            payload: payload.clone(),
            reply_size: 0,
        });
        if c.traced {
            root.inject(req.metadata_mut());
        }
        c.client
            .echo(req)
            .map(drop)
            .map_err(|st| anyhow::anyhow!("{}: {st}", c.name))
    };
    // Warm-up: connections made (the balanced channel's on first use), caches warm.
    for c in &configs {
        for _ in 0..args.calls.min(2000) {
            call(c)?;
        }
    }
    let started = Instant::now();
    for _ in 0..args.rounds {
        for c in &mut configs {
            for _ in 0..args.calls {
                let t = Instant::now();
                call(c)?;
                let ns = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
                let _ = c.hist.record(ns.max(1));
            }
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let base = configs[0].hist.value_at_quantile(0.5).max(1) as f64;
    let rows: Vec<Row> = configs
        .iter()
        .map(|c| Row {
            config: c.name,
            calls: c.hist.len(),
            p50_ns: c.hist.value_at_quantile(0.5),
            p99_ns: c.hist.value_at_quantile(0.99),
            p50_ratio: c.hist.value_at_quantile(0.5) as f64 / base,
        })
        .collect();
    let mut table = format!(
        "Microservice layers: 32 B blocking echo, one outstanding, {} rounds of {} calls \
         per configuration, interleaved ({secs:.0} s)\n\n\
         | configuration | p50 | p99 | p50 / plain |\n|---|---:|---:|---:|\n",
        args.rounds, args.calls
    );
    for r in &rows {
        table.push_str(&format!(
            "| {} | {:.2} µs | {:.2} µs | {:.3} |\n",
            r.config,
            r.p50_ns as f64 / 1000.0,
            r.p99_ns as f64 / 1000.0,
            r.p50_ratio
        ));
    }
    print!("{table}");
    if let Some(path) = &args.json {
        let doc = serde_json::json!({
            "command": std::env::args().collect::<Vec<_>>().join(" "),
            "machine": crate::measure::Machine::this().describe(),
            "rounds": args.rounds,
            "calls": args.calls,
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("write {}", path.display()))?;
        println!("\nJSON: {}", path.display());
    }
    drop(configs);
    rt.block_on(async {
        let (a, b, c, d) = servers;
        for s in [a, b, c, d] {
            s.shutdown().await;
        }
    });
    Ok(())
}
