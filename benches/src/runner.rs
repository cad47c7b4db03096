//! `rpc-bench run`: the interleaved runs, from the client side.
//!
//! For each repetition, for each size, for each system in turn (a, b, c, a, b, c, ...): start
//! that system's server process on the server host, connect, warm up and time one-outstanding
//! calls, then warm up and time each many-outstanding count, disconnect, stop the server. Then,
//! for each streaming size, for each system that streams, the same with the streaming phases
//! (ping-pong on one bidi call, server streaming, pipelined bidi). Only one system's processes
//! exist at a time, so a busy-polling server never steals the core of another system's
//! measurement. Figures are medians over the repetitions.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rpc_core::verbs::ProviderKind;

use crate::client::{BenchClient, MAX_OUTSTANDING, Probe, Snapshot};
use crate::control::{self, Remote};
use crate::load::BackgroundLoad;
use crate::measure::{self, Machine, Plan};
use crate::report::{self, Cell, Issue3, LatencyFig, RateFig, Report, System};
use crate::rpc_client::AsyncMode;
use crate::server::PollArg;
use crate::stream::{self, DEFAULT_PIPELINE, DEFAULT_STREAM_SIZES};
use crate::stream_report::{self, StreamCell, StreamFig, StreamReport};
use crate::sys;
use crate::tonic_client::{self, Flavor, Window};

/// The sizes of issue 6.
pub const DEFAULT_SIZES: [usize; 6] = [32, 256, 4 << 10, 64 << 10, 1 << 20, 16 << 20];
/// Goodput is shown from this size up.
pub const LARGE_FROM: usize = 64 << 10;
/// The issue-3 bulk size.
pub const BULK_SIZE: usize = 4 << 20;
/// Largest payload the harness accepts (tonic's limit is set to 64 MiB).
pub const MAX_SIZE: usize = 32 << 20;
/// Default HTTP/2 window for tonic: large enough that 16 MiB messages are not throttled by
/// flow control (the default 64 KiB window costs tonic most of its bulk goodput).
pub const DEFAULT_TONIC_WINDOW: u32 = 8 << 20;

/// Arguments of `rpc-bench run`.
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// CI mode: short phases, 3 repetitions; finishes in under a minute.
    #[arg(long)]
    pub quick: bool,
    /// Interleaved repetitions (default 7, quick 3); figures are their medians.
    #[arg(long)]
    pub reps: Option<usize>,
    /// Payload sizes, comma-separated (32, 4KiB, 16MiB, ...).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Option<Vec<usize>>,
    /// Message sizes of the streaming measurements (default: 32 B, 4 KiB, 64 KiB and 1 MiB;
    /// `--sizes` when that is given).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub stream_sizes: Option<Vec<usize>>,
    /// Skip the streaming measurements.
    #[arg(long)]
    pub no_streaming: bool,
    /// Run only the streaming measurements (no unary phases), at `--stream-sizes` (or
    /// `--sizes`).
    #[arg(long, conflicts_with = "no_streaming")]
    pub streaming_only: bool,
    /// Messages in flight on the pipelined bidi call of the streaming measurements (0: skip
    /// that phase).
    #[arg(long, default_value_t = DEFAULT_PIPELINE)]
    pub stream_pipeline: usize,
    /// Outstanding-call counts of the throughput phases (1 is always the latency phase).
    #[arg(long, value_delimiter = ',', default_value = "8,64")]
    pub outstanding: Vec<usize>,
    /// Systems, in the order they are interleaved.
    #[arg(
        long,
        value_delimiter = ',',
        value_enum,
        default_value = "rpc,rpc-async,rpc-plain,tonic-ct,tonic-mt,raw"
    )]
    pub systems: Vec<System>,
    /// Where the JSON results go.
    #[arg(long, default_value = "bench-out/results.json")]
    pub json: PathBuf,
    /// Directory for the plots (default: the JSON file's directory).
    #[arg(long)]
    pub plots: Option<PathBuf>,
    /// Draw no plots.
    #[arg(long)]
    pub no_plots: bool,
    /// Two-host mode: the address of `rpc-bench serve --listen ADDR` on the server host.
    #[arg(long, value_name = "ADDR")]
    pub connect: Option<String>,
    /// RDMA provider for rdma-rpc and the raw ping-pong: soft, or ib (build with
    /// `--features ibverbs`).
    #[arg(long, default_value = "soft")]
    pub provider: String,
    /// Core for this (client) process (default 1 on machines with 2 or more CPUs).
    #[arg(long)]
    pub client_core: Option<usize>,
    /// Core for the server processes (default 0).
    #[arg(long)]
    pub server_core: Option<usize>,
    /// Pin nothing.
    #[arg(long)]
    pub no_pin: bool,
    /// rdma-rpc's shard poll mode.
    #[arg(long, value_enum, default_value = "busy")]
    pub rpc_poll: PollArg,
    /// How rdma-rpc's many-outstanding phases drive calls.
    #[arg(long, value_enum, default_value = "pipeline")]
    pub rpc_async: AsyncMode,
    /// tonic: initial HTTP/2 stream and connection window, bytes (0: tonic's 64 KiB default).
    #[arg(long, default_value_t = DEFAULT_TONIC_WINDOW)]
    pub tonic_window: u32,
    /// tonic: adaptive (BDP) HTTP/2 windows.
    #[arg(long)]
    pub tonic_adaptive_window: bool,
    /// tonic: serve through the generated adapter instead of a native tonic implementation.
    #[arg(long)]
    pub tonic_adapter: bool,
    /// Skip an outstanding count when count x size exceeds this many bytes (default 128 MiB,
    /// quick 16 MiB).
    #[arg(long, value_parser = parse_size)]
    pub max_inflight: Option<usize>,
    /// Warm-up before each timed phase, seconds.
    #[arg(long)]
    pub warmup_secs: Option<f64>,
    /// Length of each latency phase, seconds.
    #[arg(long)]
    pub latency_secs: Option<f64>,
    /// Length of each throughput phase, seconds.
    #[arg(long)]
    pub rate_secs: Option<f64>,
    /// Skip the issue-3 extras (32 outstanding, 4 MiB echo, memcpy).
    #[arg(long)]
    pub no_issue3: bool,
    /// Busy threads spinning through every measured phase of every system, in a process of
    /// their own and not pinned (they compete with the benchmark for every core): a shared
    /// host. 0: none.
    #[arg(long, default_value_t = 0)]
    pub background_load: usize,
    /// Abort the whole run after this many seconds (default 300 quick, 1800 full).
    #[arg(long)]
    pub max_secs: Option<u64>,
    /// No progress bar.
    #[arg(long)]
    pub no_progress: bool,
    /// Timeout each rdma-rpc and tonic call carries, seconds (0: none; a hung call then
    /// stops the run only at `--max-secs`).
    #[arg(long, default_value_t = crate::client::CALL_TIMEOUT.as_secs_f64())]
    pub call_timeout: f64,
}

/// `32`, `256B`, `4KiB`, `4K`, `16MiB`, `1M` -> bytes.
///
/// # Errors
/// For anything else.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: usize = n.parse().map_err(|_| format!("bad size {s:?}"))?;
    let mul = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" | "kb" => 1 << 10,
        "m" | "mib" | "mb" => 1 << 20,
        _ => return Err(format!("bad size unit in {s:?} (use B, KiB or MiB)")),
    };
    n.checked_mul(mul)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

/// Everything fixed for the run.
struct Cfg {
    provider: ProviderKind,
    plan: Plan,
    server_core: Option<usize>,
    rpc_poll: PollArg,
    rpc_async: AsyncMode,
    window: Window,
    adapter: bool,
    max_inflight: usize,
    server_max_secs: u64,
    deadline: Option<Duration>,
    pipeline: usize,
}

struct RemoteProbe<'a>(&'a mut Remote);

impl Probe for RemoteProbe<'_> {
    fn snapshot(&mut self) -> Result<Snapshot> {
        let (server, server_nic) = self.0.server_usage()?;
        Ok(Snapshot {
            client: sys::process_cpu(),
            server,
            client_nic: sys::nic_counters(),
            server_nic,
        })
    }
}

fn server_args(cfg: &Cfg, system: System, size: usize) -> Vec<String> {
    let mut a: Vec<String> = Vec::new();
    let mut push = |xs: &[&str]| a.extend(xs.iter().map(|s| s.to_string()));
    match system {
        System::Rpc | System::RpcPlain | System::RpcAsync => push(&[
            "--system",
            "rpc",
            "--provider",
            cfg.provider.name(),
            "--poll",
            match cfg.rpc_poll {
                PollArg::Busy => "busy",
                PollArg::Adaptive => "adaptive",
                PollArg::Event => "event",
            },
        ]),
        System::TonicCt | System::TonicMt => {
            push(&[
                "--system",
                "tonic",
                "--runtime",
                if system == System::TonicCt {
                    "ct"
                } else {
                    "mt"
                },
            ]);
            push(&["--window", &cfg.window.initial.unwrap_or(0).to_string()]);
            if cfg.window.adaptive {
                push(&["--adaptive-window"]);
            }
            if cfg.adapter {
                push(&["--adapter"]);
            }
        }
        System::Raw => push(&[
            "--system",
            "raw",
            "--provider",
            cfg.provider.name(),
            "--max-size",
            &size.to_string(),
        ]),
    }
    // tonic-mt spreads over every core: pinning it to one would cripple it.
    if let Some(c) = cfg.server_core
        && system != System::TonicMt
    {
        push(&["--core", &c.to_string()]);
    }
    push(&["--max-secs", &cfg.server_max_secs.to_string()]);
    a
}

/// Whether `system` has a cell at `size`: rpc-plain only from 16 KiB (below, nothing is
/// opted into: the same as rdma-rpc), rpc-async only at 32 B.
fn measured_at(system: System, size: usize) -> bool {
    match system {
        System::RpcPlain => size >= crate::rpc_client::REGISTERED_MIN,
        System::RpcAsync => size == 32,
        _ => true,
    }
}

/// Runs `f` with the calling thread allowed on every core (threads it spawns keep that), then
/// restores the previous affinity.
fn unpinned<T>(f: impl FnOnce() -> T) -> T {
    let before = sys::current_affinity();
    let all: Vec<usize> = (0..sys::online_cpus()).collect();
    sys::pin_current_thread(&all);
    let r = f();
    sys::pin_current_thread(&before);
    r
}

fn connect(
    cfg: &Cfg,
    system: System,
    addr: std::net::SocketAddr,
    size: usize,
) -> Result<Box<dyn BenchClient>> {
    match system {
        System::Rpc | System::RpcPlain | System::RpcAsync => {
            let opts = crate::rpc_client::Opts {
                provider: cfg.provider,
                mode: if system == System::RpcAsync {
                    AsyncMode::Poller
                } else {
                    cfg.rpc_async
                },
                deadline: cfg.deadline,
                opt_ins: system != System::RpcPlain,
                async_latency: system == System::RpcAsync,
            };
            if opts.mode == AsyncMode::Poller {
                unpinned(|| crate::rpc_client::connect(addr, &opts))
            } else {
                crate::rpc_client::connect(addr, &opts)
            }
        }
        System::TonicCt => tonic_client::connect(addr, Flavor::Ct, cfg.window, cfg.deadline),
        System::TonicMt => {
            unpinned(|| tonic_client::connect(addr, Flavor::Mt, cfg.window, cfg.deadline))
        }
        System::Raw => crate::raw::connect(cfg.provider, addr, size),
    }
}

fn run_cell(
    remote: &mut Remote,
    cfg: &Cfg,
    rep: usize,
    system: System,
    size: usize,
    ks: &[usize],
) -> Cell {
    let started = Instant::now();
    let mut cell = Cell {
        secs: 0.0,
        rep,
        system,
        size,
        load1: measure::load_avg().map(|l| l[0]),
        latency: None,
        rates: Vec::new(),
        skipped: Vec::new(),
        error: None,
    };
    let r = (|| -> Result<()> {
        let addr = remote.start(&server_args(cfg, system, size))?;
        let mut client = connect(cfg, system, addr, size)?;
        let mut probe = RemoteProbe(remote);
        let lat = client.latency(size, &cfg.plan, &mut probe)?;
        cell.latency = Some(LatencyFig::from_run(size, &lat));
        for &k in ks {
            if k.saturating_mul(size) > cfg.max_inflight {
                cell.skipped.push(k);
                continue;
            }
            let r = client.rate(size, k, &cfg.plan, &mut probe)?;
            cell.rates.push(RateFig::from_run(size, k, &r));
        }
        drop(client);
        Ok(())
    })();
    let stopped = remote.stop();
    if let Err(e) = r.and(stopped) {
        cell.error = Some(format!(
            "{} {}: {e:#}",
            system.name(),
            report::size_name(size)
        ));
    }
    cell.secs = started.elapsed().as_secs_f64();
    cell
}

fn run_stream_cell(
    remote: &mut Remote,
    cfg: &Cfg,
    rep: usize,
    system: System,
    size: usize,
) -> StreamCell {
    let started = Instant::now();
    let mut cell = StreamCell {
        rep,
        system,
        size,
        load1: measure::load_avg().map(|l| l[0]),
        ping_pong: None,
        server_stream: None,
        bidi: None,
        skipped: Vec::new(),
        error: None,
        secs: 0.0,
    };
    // The adapter serves rdma-rpc's implementation over gRPC, which cannot take streaming
    // requests yet: only server streaming runs through it.
    let bidi_ok = !(cfg.adapter && system.is_tonic());
    let r = (|| -> Result<()> {
        let addr = remote.start(&server_args(cfg, system, size))?;
        let mut client = connect(cfg, system, addr, size)?;
        let mut probe = RemoteProbe(remote);
        let s = client
            .streams()
            .ok_or_else(|| anyhow::anyhow!("{} has no streaming calls", system.name()))?;
        if bidi_ok {
            let pp = s.ping_pong(size, &cfg.plan, &mut probe)?;
            cell.ping_pong = Some(LatencyFig::from_run(size, &pp));
        } else {
            cell.skipped
                .push("ping-pong: the tonic adapter cannot serve bidi calls".into());
        }
        let st = s.server_stream(size, &cfg.plan, &mut probe)?;
        cell.server_stream = Some(StreamFig::from_run(size, 1, 0, &st));
        let k = cfg.pipeline;
        if k == 0 {
            cell.skipped.push("bidi: --stream-pipeline 0".into());
        } else if !bidi_ok {
            cell.skipped
                .push("bidi: the tonic adapter cannot serve bidi calls".into());
        } else if k.saturating_mul(size) > cfg.max_inflight {
            cell.skipped.push(format!(
                "bidi: {k} x {} in flight exceeds the in-flight limit",
                report::size_name(size)
            ));
        } else {
            let b = s.bidi(size, k, &cfg.plan, &mut probe)?;
            cell.bidi = Some(StreamFig::from_run(size, 2, k, &b));
        }
        drop(client);
        Ok(())
    })();
    let stopped = remote.stop();
    if let Err(e) = r.and(stopped) {
        cell.error = Some(format!(
            "{} {} streaming: {e:#}",
            system.name(),
            report::size_name(size)
        ));
    }
    cell.secs = started.elapsed().as_secs_f64();
    cell
}

/// Runs the benchmark; writes the JSON file and plots; returns the report.
///
/// # Errors
/// When the arguments are invalid or the server host cannot be reached. Failed cells are
/// recorded in the report instead.
pub fn run(args: &RunArgs, command: String) -> Result<Report> {
    let started = Instant::now();
    let quick = args.quick;
    let secs = |v: Option<f64>, quick_d: f64, full: f64| {
        Duration::from_secs_f64(v.unwrap_or(if quick { quick_d } else { full }).max(0.0))
    };
    let plan = Plan {
        warmup: secs(args.warmup_secs, 0.02, 0.1),
        latency: secs(args.latency_secs, 0.1, 0.5),
        rate: secs(args.rate_secs, 0.05, 0.3),
        min_calls: if quick { 3 } else { 10 },
        max_phase: Duration::from_secs(if quick { 5 } else { 20 }),
    };
    // More, shorter repetitions: medians over more interleaved runs resist a noisy machine.
    let reps = args.reps.unwrap_or(if quick { 3 } else { 7 }).max(1);
    let sizes = if args.streaming_only {
        Vec::new()
    } else {
        args.sizes.clone().unwrap_or_else(|| DEFAULT_SIZES.to_vec())
    };
    let stream_systems: Vec<System> = if args.no_streaming {
        Vec::new()
    } else {
        args.systems
            .iter()
            .copied()
            .filter(|&s| !matches!(s, System::Raw | System::RpcPlain | System::RpcAsync))
            .collect()
    };
    let stream_sizes = if stream_systems.is_empty() {
        Vec::new()
    } else {
        args.stream_sizes
            .clone()
            .or_else(|| args.sizes.clone())
            .unwrap_or_else(|| DEFAULT_STREAM_SIZES.to_vec())
    };
    if sizes
        .iter()
        .chain(&stream_sizes)
        .any(|&s| s == 0 || s > MAX_SIZE)
    {
        bail!(
            "sizes must be between 1 byte and {}",
            report::size_name(MAX_SIZE)
        );
    }
    if args
        .outstanding
        .iter()
        .any(|&k| k == 0 || k > MAX_OUTSTANDING)
    {
        bail!("outstanding counts must be between 1 and {MAX_OUTSTANDING}");
    }
    if args.stream_pipeline > MAX_OUTSTANDING {
        bail!("--stream-pipeline must be at most {MAX_OUTSTANDING}");
    }
    if args.systems.is_empty() {
        bail!("no system to run");
    }
    let provider: ProviderKind = args.provider.parse()?;
    let max_secs = args.max_secs.unwrap_or(if quick { 300 } else { 1800 });
    control::watchdog(Duration::from_secs(max_secs), "run");

    let cpus = sys::online_cpus();
    let pin = !args.no_pin && cpus >= 2;
    let client_core = args.client_core.or(pin.then_some(1));
    let server_core = args.server_core.or(pin.then_some(0));
    if let Some(c) = client_core
        && !args.no_pin
        && !sys::pin_current_thread(&[c])
    {
        eprintln!("rpc-bench: could not pin the client to core {c}; running unpinned");
    }
    let cfg = Cfg {
        provider,
        plan,
        server_core: server_core.filter(|_| !args.no_pin),
        rpc_poll: args.rpc_poll,
        rpc_async: args.rpc_async,
        window: Window {
            initial: (args.tonic_window > 0).then_some(args.tonic_window),
            adaptive: args.tonic_adaptive_window,
        },
        adapter: args.tonic_adapter,
        deadline: (args.call_timeout > 0.0).then(|| Duration::from_secs_f64(args.call_timeout)),
        max_inflight: args
            .max_inflight
            .unwrap_or(if quick { 16 << 20 } else { 128 << 20 }),
        server_max_secs: max_secs.min(600),
        pipeline: args.stream_pipeline,
    };

    let mut remote = match &args.connect {
        Some(addr) => Remote::connect(addr)?,
        None => Remote::spawn_local(max_secs + 30)?,
    };
    let machine = Machine::this();
    let server_machine = remote.info().unwrap_or_else(|e| format!("unknown ({e:#})"));
    let load_before = measure::load_avg();
    let started_unix = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());

    // Started before the first phase and stopped after the last: every phase of every system
    // runs beside it. It stops by itself with the run's watchdog, and with this process.
    let mut load = BackgroundLoad::start(args.background_load, max_secs)?;
    let mut load_lost = false;
    let mut check_load = |bar: &ProgressBar| {
        if args.background_load > 0 && !load_lost && !load.running() {
            load_lost = true;
            bar.suspend(|| eprintln!("rpc-bench: the background load stopped early"));
        }
    };

    let issue3 = !args.no_issue3 && !args.streaming_only && args.systems.contains(&System::Rpc);
    let unary_cells = sizes
        .iter()
        .flat_map(|&size| args.systems.iter().map(move |&s| (size, s)))
        .filter(|&(size, s)| measured_at(s, size))
        .count();
    let per_rep =
        unary_cells + if issue3 { 2 } else { 0 } + stream_sizes.len() * stream_systems.len();
    let bar = if args.no_progress {
        ProgressBar::hidden()
    } else {
        ProgressBar::with_draw_target(Some((reps * per_rep) as u64), ProgressDrawTarget::stderr())
    };
    bar.set_style(
        ProgressStyle::with_template(
            "{bar:32.cyan/blue} {pos}/{len} {elapsed_precise} eta {eta} {msg}",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );

    let mut cells = Vec::new();
    let mut bulk_cells = Vec::new();
    let mut memcpy = Vec::new();
    let mut stream_cells = Vec::new();
    for rep in 0..reps {
        for &size in &sizes {
            for &system in &args.systems {
                if !measured_at(system, size) {
                    continue;
                }
                bar.set_message(format!(
                    "rep {}/{reps}: {} {}",
                    rep + 1,
                    system.name(),
                    report::size_name(size)
                ));
                let mut ks = args.outstanding.clone();
                if issue3 && system == System::Rpc && size == 32 && !ks.contains(&32) {
                    ks.push(32);
                }
                let cell = run_cell(&mut remote, &cfg, rep, system, size, &ks);
                if let Some(e) = &cell.error {
                    bar.suspend(|| eprintln!("rpc-bench: {e}"));
                }
                cells.push(cell);
                check_load(&bar);
                bar.inc(1);
            }
        }
        if issue3 {
            bar.set_message(format!("rep {}/{reps}: rdma-rpc 4 MiB echo", rep + 1));
            let cell = run_cell(&mut remote, &cfg, rep, System::Rpc, BULK_SIZE, &[4]);
            if let Some(e) = &cell.error {
                bar.suspend(|| eprintln!("rpc-bench: {e}"));
            }
            bulk_cells.push(cell);
            bar.inc(1);
            bar.set_message(format!("rep {}/{reps}: memcpy 4 MiB", rep + 1));
            memcpy.push(measure::memcpy_gbps(BULK_SIZE, plan.rate.max(plan.warmup)));
            bar.inc(1);
        }
        // Streaming (issue 7), interleaved the same way: each size, each system in turn.
        for &size in &stream_sizes {
            for &system in &stream_systems {
                bar.set_message(format!(
                    "rep {}/{reps}: {} {} streaming",
                    rep + 1,
                    system.name(),
                    report::size_name(size)
                ));
                let cell = run_stream_cell(&mut remote, &cfg, rep, system, size);
                if let Some(e) = &cell.error {
                    bar.suspend(|| eprintln!("rpc-bench: {e}"));
                }
                stream_cells.push(cell);
                check_load(&bar);
                bar.inc(1);
            }
        }
    }
    bar.finish_and_clear();
    drop(load);
    drop(remote);

    let rows = report::summarize(&cells);
    let ratios = report::ratios(&rows);
    let i3 = if issue3 {
        let rpc32 = rows
            .iter()
            .find(|r| r.system == System::Rpc && r.size == 32);
        let bulk = report::summarize(&bulk_cells);
        Issue3 {
            p50_us: rpc32.and_then(|r| r.p50_us),
            p99_us: rpc32.and_then(|r| r.p99_us),
            calls_per_s_32: rpc32.and_then(|r| r.rates.get(&32)).map(|r| r.calls_per_s),
            goodput_4mib_gbps: bulk
                .first()
                .and_then(|r| r.rates.values().map(|s| s.goodput_gbps).reduce(f64::max)),
            memcpy_4mib_gbps: report::median(memcpy),
        }
    } else {
        Issue3::default()
    };
    let targets = report::targets(&rows, &ratios, &i3);
    let streaming = (!stream_cells.is_empty()).then(|| {
        let rows = stream_report::summarize(&stream_cells);
        StreamReport {
            sizes: stream_sizes.clone(),
            pipeline: cfg.pipeline,
            messages_per_call: stream_sizes
                .iter()
                .map(|&s| (s, stream::messages_per_call(s)))
                .collect(),
            ratios: stream_report::ratios(&rows),
            rows,
            errors: stream_cells
                .iter()
                .filter_map(|c| c.error.clone())
                .collect(),
            cells: stream_cells,
        }
    });
    let errors: Vec<String> = cells
        .iter()
        .chain(&bulk_cells)
        .filter_map(|c| c.error.clone())
        .chain(streaming.iter().flat_map(|s| s.errors.iter().cloned()))
        .chain(load_lost.then(|| "the background load stopped before the run ended".into()))
        .collect();
    cells.extend(bulk_cells);
    let config = serde_json::json!({
        "provider": provider.name(),
        "reps": reps,
        "sizes": sizes,
        "stream_sizes": stream_sizes,
        "stream_pipeline": cfg.pipeline,
        "outstanding": args.outstanding,
        "systems": args.systems,
        "two_host": args.connect,
        "client_core": client_core.filter(|_| !args.no_pin),
        "server_core": cfg.server_core,
        "rpc_poll": format!("{:?}", args.rpc_poll).to_lowercase(),
        "rpc_async": args.rpc_async,
        "tonic_window": cfg.window,
        "tonic_adapter": cfg.adapter,
        "max_inflight": cfg.max_inflight,
        "call_timeout_s": cfg.deadline.map(|d| d.as_secs_f64()),
        "quick": quick,
        "background_load": args.background_load,
    });
    let report = Report {
        command,
        machine,
        server_machine,
        started_unix,
        seconds: started.elapsed().as_secs_f64(),
        load_before,
        load_after: measure::load_avg(),
        config,
        plan,
        rows,
        ratios,
        issue3: i3,
        targets,
        streaming,
        cells,
        errors,
    };
    if let Some(dir) = args.json.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("write {}", args.json.display()))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("32"), Ok(32));
        assert_eq!(parse_size("256B"), Ok(256));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("4k"), Ok(4096));
        assert_eq!(parse_size("16MiB"), Ok(16 << 20));
        assert!(parse_size("MiB").is_err());
        assert!(parse_size("4 GiB").is_err());
        assert!(parse_size("99999999999999999999").is_err());
    }

    #[test]
    fn tonic_mt_servers_are_not_pinned() {
        let cfg = Cfg {
            provider: ProviderKind::Soft,
            plan: Plan {
                warmup: Duration::ZERO,
                latency: Duration::ZERO,
                rate: Duration::ZERO,
                min_calls: 1,
                max_phase: Duration::from_secs(1),
            },
            server_core: Some(0),
            rpc_poll: PollArg::Busy,
            rpc_async: AsyncMode::Caller,
            window: Window {
                initial: Some(1 << 20),
                adaptive: false,
            },
            adapter: false,
            max_inflight: 1 << 20,
            server_max_secs: 10,
            deadline: None,
            pipeline: 8,
        };
        let mt = server_args(&cfg, System::TonicMt, 32);
        assert!(!mt.contains(&"--core".to_string()));
        assert!(
            mt.windows(2)
                .any(|w| w[0] == "--window" && w[1] == "1048576")
        );
        let rpc = server_args(&cfg, System::Rpc, 32);
        assert!(rpc.windows(2).any(|w| w[0] == "--core" && w[1] == "0"));
        let raw = server_args(&cfg, System::Raw, 4096);
        assert!(
            raw.windows(2)
                .any(|w| w[0] == "--max-size" && w[1] == "4096")
        );
    }
}
