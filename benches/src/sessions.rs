//! `rpc-bench sessions` (issue 14): many connections against one server with one shard, for
//! rdma-rpc and tonic in the same run.
//!
//! For each system, for each connection count: start a fresh server process (rdma-rpc as
//! `Server::builder()` makes it, optionally with `--max-connections`; tonic's default server on
//! one thread), read its memory and descriptors with no connection, start the client processes
//! (`rpc-bench sessions-client`, copies of this binary) and have them open their shares of the
//! count at once, each timing connect + first 32 B call per connection; with everything open
//! and idle read the server again; then 1% of the connections (at least one) make 32 B calls
//! for `--load-secs`; stop everything. Every phase is bounded: a client stops opening after
//! `--phase-secs` or `--give-up` failures in a row and reports the rest as not attempted, and a
//! client that does not answer in time is killed and reported.
//!
//! Server memory is read from `/proc/PID/status`: VmRSS, which already includes the shared
//! memory the process has touched (RssShmem: the soft RNIC's memfd segments), so the two are
//! not added; RssShmem is shown as its own part.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::control::ServerProc;
use crate::measure::Machine;
use crate::sessions_client::{self, LoadReply, OpenReply, SessionPoller, SessionSystem};

/// How long the processes get beyond the limits they are told, before they count as hung.
const ANSWER_GRACE: Duration = Duration::from_secs(20);
/// Descriptors the harness's own processes need beyond one per connection.
const FD_MARGIN: u64 = 256;

/// Arguments of `rpc-bench sessions`.
#[derive(Clone, Debug, clap::Args)]
pub struct SessionArgs {
    /// Connection counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,100,1000,10000")]
    pub counts: Vec<u64>,
    /// Client processes the connections are spread over.
    #[arg(long, default_value_t = 4)]
    pub client_procs: u64,
    /// Systems, in the order they run.
    #[arg(long, value_delimiter = ',', value_enum, default_value = "rpc,tonic")]
    pub systems: Vec<SessionSystem>,
    /// rdma-rpc: `ServerBuilder::max_connections_per_shard` (default: the builder's).
    #[arg(long)]
    pub max_connections: Option<u32>,
    /// RDMA provider for rdma-rpc.
    #[arg(long, default_value = "soft")]
    pub provider: String,
    /// rdma-rpc channels' poller: `thread` (the builder's default, the process's poller thread) or
    /// `caller` (the calling task drives its connection: no thread per channel).
    #[arg(long, value_enum, default_value = "thread")]
    pub client_poller: SessionPoller,
    /// How long the active connections make calls, seconds.
    #[arg(long, default_value_t = 3.0)]
    pub load_secs: f64,
    /// Active connections during the load, at every count (default: 1% of the count, at
    /// least one): `--active 1` measures what the connections held open cost a lone caller.
    #[arg(long)]
    pub active: Option<u64>,
    /// Most seconds the clients spend opening the connections of one count.
    #[arg(long, default_value_t = 60.0)]
    pub phase_secs: f64,
    /// A client process stops opening after this many failures in a row (0: never).
    #[arg(long, default_value_t = 200)]
    pub give_up: u64,
    /// Pause before reading the server (just started; all connections open), milliseconds.
    #[arg(long, default_value_t = 500)]
    pub settle_ms: u64,
    /// Where the JSON results go (the table goes beside it as .txt, the plots too).
    #[arg(long, default_value = "bench-out/sessions.json")]
    pub json: PathBuf,
    /// Draw no plot.
    #[arg(long)]
    pub no_plots: bool,
    /// Exit after this many seconds whatever happens.
    #[arg(long, default_value_t = 900)]
    pub max_secs: u64,
    /// Pin the server to the last core and the client processes to the others (as `rpc-bench
    /// run` pins its two processes): the figures then measure the work, not where the
    /// scheduler placed the threads of both sides on a small host.
    #[arg(long)]
    pub pin: bool,
}

/// With `--pin`: the server's core and the clients' cores (none on a one-core host).
fn pinned_cores(args: &SessionArgs) -> Option<(usize, Vec<usize>)> {
    let n = crate::sys::online_cpus();
    (args.pin && n >= 2).then(|| (n - 1, (0..n - 1).collect()))
}

/// What `/proc/PID/status` and `/proc/PID/fd` say of a process.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct ProcStatus {
    /// Resident memory, KiB (anonymous + file + shared).
    pub vm_rss_kib: u64,
    /// Its anonymous part.
    pub rss_anon_kib: u64,
    /// Its file-backed part.
    pub rss_file_kib: u64,
    /// Its shared-memory part (memfd, shmem).
    pub rss_shmem_kib: u64,
    /// Memory pinned for the device (VmPin: registered memory regions on the `ib` provider)
    /// plus locked memory (VmLck), KiB. The soft provider pins nothing.
    pub pinned_kib: u64,
    /// Threads.
    pub threads: u64,
    /// Open descriptors.
    pub fds: u64,
}

impl ProcStatus {
    /// Reads process `pid`; `None` when it is gone.
    pub fn read(pid: u32) -> Option<ProcStatus> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .and_then(|v| v.split_whitespace().next()?.parse().ok())
                .unwrap_or(0)
        };
        let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64);
        Some(ProcStatus {
            vm_rss_kib: field("VmRSS"),
            rss_anon_kib: field("RssAnon"),
            rss_file_kib: field("RssFile"),
            rss_shmem_kib: field("RssShmem"),
            pinned_kib: field("VmPin") + field("VmLck"),
            threads: field("Threads"),
            fds,
        })
    }
}

/// Latency quantiles, microseconds.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Quantiles {
    /// Samples.
    pub n: u64,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

impl Quantiles {
    fn of(h: &hdrhistogram::Histogram<u64>) -> Option<Quantiles> {
        (!h.is_empty()).then(|| Quantiles {
            n: h.len(),
            p50_us: h.value_at_quantile(0.5) as f64 / 1e3,
            p99_us: h.value_at_quantile(0.99) as f64 / 1e3,
        })
    }
}

/// The load phase of one cell.
#[derive(Clone, Debug, Default, Serialize)]
pub struct LoadFig {
    /// Connections making calls.
    pub active: u64,
    /// Calls that succeeded.
    pub calls: u64,
    /// Successful calls per second, all clients together.
    pub calls_per_s: f64,
    /// Their latency.
    pub latency: Option<Quantiles>,
    /// Calls that failed.
    pub errors: u64,
    /// The first failure.
    pub first_error: Option<String>,
}

/// One system at one connection count.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    /// Which system.
    pub system: SessionSystem,
    /// Connections asked for.
    pub count: u64,
    /// Client processes used.
    pub client_procs: u64,
    /// Connections opened (connected and answered their first call).
    pub opened: u64,
    /// Attempts that failed.
    pub failed: u64,
    /// Connections never attempted (a limit of the run was reached first).
    pub not_attempted: u64,
    /// The first failure (of an attempt, or of the cell itself).
    pub first_error: Option<String>,
    /// Connect + first 32 B call, per opened connection.
    pub connect_first_call: Option<Quantiles>,
    /// The server with no connection.
    pub server_idle: Option<ProcStatus>,
    /// The server with every opened connection open and idle.
    pub server_open: Option<ProcStatus>,
    /// (server VmRSS open - idle) / opened, KiB.
    pub server_kib_per_conn: Option<f64>,
    /// Its shared-memory part, KiB.
    pub server_shmem_kib_per_conn: Option<f64>,
    /// (server pinned memory open - idle) / opened, KiB (see [`ProcStatus::pinned_kib`]).
    pub server_pinned_kib_per_conn: Option<f64>,
    /// (server descriptors open - idle) / opened.
    pub server_fds_per_conn: Option<f64>,
    /// All client processes together, after opening: resident memory, KiB.
    pub clients_rss_kib: u64,
    /// All client processes together, after opening: threads.
    pub clients_threads: u64,
    /// All client processes together, after opening: descriptors.
    pub clients_fds: u64,
    /// (client processes' VmRSS after opening - before their first connection) / opened,
    /// KiB: what a connection costs its client (per-process state included, so the figure
    /// at one connection is the first connection's).
    pub client_kib_per_conn: Option<f64>,
    /// The same for pinned memory, KiB.
    pub client_pinned_kib_per_conn: Option<f64>,
    /// The same for descriptors.
    pub client_fds_per_conn: Option<f64>,
    /// With every connection open, 1% of them making calls.
    pub load: Option<LoadFig>,
    /// Wall time of the cell, seconds.
    pub seconds: f64,
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The command line.
    pub command: String,
    /// The machine.
    pub machine: String,
    /// Load average (1, 5, 15 min) before and after the run.
    pub load_before: Option<[f64; 3]>,
    /// See `load_before`.
    pub load_after: Option<[f64; 3]>,
    /// RLIMIT_NOFILE (soft after raising, hard) the processes ran with.
    pub nofile: (u64, u64),
    /// The run's settings.
    pub config: serde_json::Value,
    /// One per system and count, in the order they ran.
    pub cells: Vec<Cell>,
    /// Wall time, seconds.
    pub seconds: f64,
}

/// Runs `rpc-bench sessions`: measures, prints the table, writes JSON, table and plot.
///
/// # Errors
/// When nothing could be measured or the output cannot be written; a failing cell is
/// recorded in its row instead.
pub fn run(args: &SessionArgs, command: String) -> Result<()> {
    crate::control::watchdog(Duration::from_secs(args.max_secs), "sessions");
    if args.client_procs == 0 {
        bail!("--client-procs must be at least 1");
    }
    let start = Instant::now();
    let load_before = crate::measure::load_avg();
    // rdma-rpc's server holds 3 descriptors per soft connection (its TCP socket, the memfd
    // of the connection's slot region, the client's completion eventfd); tonic's one.
    let need = args.counts.iter().max().copied().unwrap_or(0) * 3 + FD_MARGIN;
    let nofile = raise_nofile(need);
    if nofile.0 < need {
        eprintln!(
            "rpc-bench sessions: RLIMIT_NOFILE is {} (hard {}), below the {need} descriptors the \
             largest count needs in the server; expect failures from descriptors",
            nofile.0, nofile.1
        );
    }
    let mut cells = Vec::new();
    for &system in &args.systems {
        for &count in &args.counts {
            eprintln!("rpc-bench sessions: {} x {count}", system.name());
            let c = cell(args, system, count);
            eprintln!("  {}", row(&c));
            cells.push(c);
        }
    }
    let report = Report {
        command,
        machine: Machine::this().describe(),
        load_before,
        load_after: crate::measure::load_avg(),
        nofile,
        config: serde_json::json!({
            "counts": args.counts,
            "client_procs": args.client_procs,
            "max_connections": args.max_connections,
            "client_poller": args.client_poller.name(),
            "provider": args.provider,
            "load_secs": args.load_secs,
            "active": args.active,
            "phase_secs": args.phase_secs,
            "give_up": args.give_up,
            "call_size": sessions_client::CALL_SIZE,
            "pin": pinned_cores(args).is_some(),
        }),
        cells,
        seconds: start.elapsed().as_secs_f64(),
    };
    let text = table(&report);
    print!("{text}");
    if let Some(dir) = args.json.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    std::fs::write(&args.json, serde_json::to_string_pretty(&report)?)
        .with_context(|| format!("write {}", args.json.display()))?;
    let txt = args.json.with_extension("txt");
    let load = |l: Option<[f64; 3]>| {
        l.map_or("unknown".into(), |l| {
            format!("{:.2}/{:.2}/{:.2}", l[0], l[1], l[2])
        })
    };
    let header = format!(
        "$ {}\n{}; load average {} before, {} after; {:.0} s\n\n",
        report.command,
        report.machine,
        load(report.load_before),
        load(report.load_after),
        report.seconds
    );
    std::fs::write(&txt, header + &text).with_context(|| format!("write {}", txt.display()))?;
    println!("\nJSON: {}\ntable: {}", args.json.display(), txt.display());
    if !args.no_plots {
        let base = args.json.with_extension("");
        match crate::sessions_plot::write(&base, &report) {
            Ok(files) => {
                for f in files {
                    println!("plot: {}", f.display());
                }
            }
            Err(e) => eprintln!("rpc-bench sessions: plot not written: {e:#}"),
        }
    }
    Ok(())
}

/// Raises RLIMIT_NOFILE (children inherit it): the hard limit to `need` where the process may
/// (CAP_SYS_RESOURCE), the soft one to the hard one; returns both.
fn raise_nofile(need: u64) -> (u64, u64) {
    // SAFETY: `rlimit` is plain data; getrlimit/setrlimit read and write only the struct we
    // pass, which lives on this stack frame.
    unsafe {
        let mut r: libc::rlimit = std::mem::zeroed();
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return (0, 0);
        }
        if r.rlim_max < need {
            let raised = libc::rlimit {
                rlim_cur: need,
                rlim_max: need,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                r = raised;
            }
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                r = raised;
            }
        }
        (r.rlim_cur, r.rlim_max)
    }
}

fn cell(args: &SessionArgs, system: SessionSystem, count: u64) -> Cell {
    let start = Instant::now();
    let mut c = Cell {
        system,
        count,
        client_procs: args.client_procs.min(count.max(1)),
        opened: 0,
        failed: 0,
        not_attempted: 0,
        first_error: None,
        connect_first_call: None,
        server_idle: None,
        server_open: None,
        server_kib_per_conn: None,
        server_shmem_kib_per_conn: None,
        server_pinned_kib_per_conn: None,
        server_fds_per_conn: None,
        clients_rss_kib: 0,
        clients_threads: 0,
        clients_fds: 0,
        client_kib_per_conn: None,
        client_pinned_kib_per_conn: None,
        client_fds_per_conn: None,
        load: None,
        seconds: 0.0,
    };
    if let Err(e) = measure(args, &mut c) {
        c.first_error.get_or_insert(format!("{e:#}"));
    }
    c.seconds = start.elapsed().as_secs_f64();
    c
}

fn measure(args: &SessionArgs, c: &mut Cell) -> Result<()> {
    let mut server_args: Vec<String> = match c.system {
        SessionSystem::Rpc => vec![
            "--system".into(),
            "rpc".into(),
            "--provider".into(),
            args.provider.clone(),
            "--builder-defaults".into(),
        ],
        SessionSystem::Tonic => vec!["--system".into(), "tonic".into()],
    };
    if let (SessionSystem::Rpc, Some(n)) = (c.system, args.max_connections) {
        server_args.extend(["--max-connections".into(), n.to_string()]);
    }
    server_args.extend(["--max-secs".into(), args.max_secs.to_string()]);
    if let Some((core, _)) = pinned_cores(args) {
        server_args.extend(["--core".into(), core.to_string()]);
    }
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let (server, port) = ServerProc::start(&server_args, loopback)?;
    let addr = SocketAddr::new(loopback, port);
    let pid = server.pid();
    let result = (|| -> Result<()> {
        std::thread::sleep(Duration::from_millis(args.settle_ms));
        c.server_idle = ProcStatus::read(pid);
        let mut clients = (0..c.client_procs)
            .map(|_| ClientProc::spawn(args, c.system, addr))
            .collect::<Result<Vec<_>>>()?;
        open_all(args, c, &mut clients)?;
        std::thread::sleep(Duration::from_millis(args.settle_ms));
        c.server_open = ProcStatus::read(pid);
        if let (Some(idle), Some(open)) = (c.server_idle, c.server_open)
            && c.opened > 0
        {
            let per = |a: u64, b: u64| (a as f64 - b as f64) / c.opened as f64;
            c.server_kib_per_conn = Some(per(open.vm_rss_kib, idle.vm_rss_kib));
            c.server_shmem_kib_per_conn = Some(per(open.rss_shmem_kib, idle.rss_shmem_kib));
            c.server_pinned_kib_per_conn = Some(per(open.pinned_kib, idle.pinned_kib));
            c.server_fds_per_conn = Some(per(open.fds, idle.fds));
        }
        if c.opened > 0 {
            c.load = Some(load_all(args, c, &mut clients)?);
        }
        Ok(())
    })();
    server.stop();
    result
}

/// Each client opens its share of `c.count`, all at once.
fn open_all(args: &SessionArgs, c: &mut Cell, clients: &mut [ClientProc]) -> Result<()> {
    let procs = clients.len() as u64;
    let limit = Duration::from_secs_f64(args.phase_secs);
    for (i, cl) in clients.iter_mut().enumerate() {
        let share = c.count / procs + u64::from((i as u64) < c.count % procs);
        cl.share = share;
        cl.send(&format!(
            "OPEN {share} {} {}",
            limit.as_millis(),
            args.give_up
        ))?;
    }
    let deadline = Instant::now() + limit + ANSWER_GRACE;
    let mut parts = Vec::new();
    let (mut grown_kib, mut grown_pinned, mut grown_fds, mut measured) = (0u64, 0u64, 0u64, true);
    for (i, cl) in clients.iter_mut().enumerate() {
        match cl.answer::<OpenReply>(deadline) {
            Ok(r) => {
                c.opened += r.opened;
                c.failed += r.failed;
                c.not_attempted += r.skipped;
                c.clients_rss_kib += r.rss_kib;
                c.clients_threads += r.threads;
                c.clients_fds += r.fds;
                measured &= r.measured;
                grown_kib += r.rss_kib.saturating_sub(r.base_rss_kib);
                grown_pinned += r.pinned_kib.saturating_sub(r.base_pinned_kib);
                grown_fds += r.fds.saturating_sub(r.base_fds);
                if c.first_error.is_none() {
                    c.first_error.clone_from(&r.first_error);
                }
                cl.held = r.held;
                parts.push(r.hist);
            }
            Err(e) => {
                c.not_attempted += cl.share;
                c.first_error
                    .get_or_insert(format!("client process {i}: {e:#}"));
            }
        }
    }
    c.connect_first_call = Quantiles::of(&sessions_client::merge(&parts));
    if c.opened > 0 && measured {
        c.client_kib_per_conn = Some(grown_kib as f64 / c.opened as f64);
        c.client_pinned_kib_per_conn = Some(grown_pinned as f64 / c.opened as f64);
        c.client_fds_per_conn = Some(grown_fds as f64 / c.opened as f64);
    }
    Ok(())
}

/// 1% of the open connections (at least one) make calls, spread over the clients.
fn load_all(args: &SessionArgs, c: &Cell, clients: &mut [ClientProc]) -> Result<LoadFig> {
    let mut left = args.active.unwrap_or(c.count / 100).max(1).min(c.opened);
    let mut active = vec![0u64; clients.len()];
    while left > 0 {
        let before = left;
        for (a, cl) in active.iter_mut().zip(clients.iter()) {
            if left > 0 && *a < cl.held {
                *a += 1;
                left -= 1;
            }
        }
        if left == before {
            break;
        }
    }
    let ms = (args.load_secs * 1e3) as u64;
    for (cl, &a) in clients.iter_mut().zip(&active) {
        if a > 0 {
            cl.send(&format!("LOAD {a} {ms}"))?;
        }
    }
    let deadline = Instant::now() + Duration::from_millis(ms) + ANSWER_GRACE;
    let mut fig = LoadFig::default();
    let (mut parts, mut wall) = (Vec::new(), 0u64);
    for (i, (cl, &a)) in clients.iter_mut().zip(&active).enumerate() {
        if a == 0 {
            continue;
        }
        match cl.answer::<LoadReply>(deadline) {
            Ok(r) => {
                fig.active += r.active;
                fig.calls += r.calls;
                fig.errors += r.errors;
                if fig.first_error.is_none() {
                    fig.first_error = r.first_error;
                }
                wall = wall.max(r.wall_ns);
                parts.push(r.hist);
            }
            Err(e) => {
                fig.first_error
                    .get_or_insert(format!("client process {i}: {e:#}"));
            }
        }
    }
    if wall > 0 {
        fig.calls_per_s = fig.calls as f64 / (wall as f64 / 1e9);
    }
    fig.latency = Quantiles::of(&sessions_client::merge(&parts));
    Ok(fig)
}

/// A client process and the lines it answers, read by a thread of ours.
struct ClientProc {
    child: Child,
    input: ChildStdin,
    lines: mpsc::Receiver<String>,
    /// Connections it was asked for, and holds.
    share: u64,
    held: u64,
}

impl ClientProc {
    fn spawn(args: &SessionArgs, system: SessionSystem, addr: SocketAddr) -> Result<ClientProc> {
        let exe = std::env::current_exe().context("locate the rpc-bench executable")?;
        let system = match system {
            SessionSystem::Rpc => "rpc",
            SessionSystem::Tonic => "tonic",
        };
        let mut child = Command::new(exe)
            .args(["sessions-client", "--system", system, "--provider"])
            .arg(&args.provider)
            .arg("--addr")
            .arg(addr.to_string())
            .arg("--max-secs")
            .arg(args.max_secs.to_string())
            .arg("--die-with-parent")
            .arg("--poller")
            .arg(args.client_poller.name())
            .args(pinned_cores(args).map(|(_, cores)| {
                let list: Vec<String> = cores.iter().map(ToString::to_string).collect();
                format!("--cores={}", list.join(","))
            }))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawn a client process")?;
        let (Some(input), Some(output)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("client process has no pipes");
        };
        let (tx, lines) = mpsc::channel();
        std::thread::Builder::new()
            .name("sessions-client-reader".into())
            .spawn(move || {
                for line in BufReader::new(output).lines() {
                    let Ok(line) = line else { return };
                    if tx.send(line).is_err() {
                        return;
                    }
                }
            })?;
        Ok(ClientProc {
            child,
            input,
            lines,
            share: 0,
            held: 0,
        })
    }

    fn send(&mut self, cmd: &str) -> Result<()> {
        writeln!(self.input, "{cmd}")?;
        self.input.flush().context("write to a client process")
    }

    fn answer<T: DeserializeOwned>(&mut self, deadline: Instant) -> Result<T> {
        let wait = deadline.saturating_duration_since(Instant::now());
        let line = match self.lines.recv_timeout(wait) {
            Ok(l) => l,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = self.child.kill();
                bail!("no answer within its time limit; killed");
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let status = self.child.try_wait().ok().flatten();
                bail!("ended (status {status:?}); see its messages above");
            }
        };
        serde_json::from_str(&line).map_err(|e| anyhow!("bad answer {line:?}: {e}"))
    }
}

impl Drop for ClientProc {
    fn drop(&mut self) {
        let _ = writeln!(self.input, "QUIT");
        let _ = self.input.flush();
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn opt(v: Option<f64>, digits: usize) -> String {
    v.map_or("-".into(), |v| format!("{v:.digits$}"))
}

fn row(c: &Cell) -> String {
    let (p50, p99) = c
        .connect_first_call
        .map_or((None, None), |q| (Some(q.p50_us), Some(q.p99_us)));
    let load = c.load.as_ref();
    format!(
        "{:<9}{:>7}{:>8}{:>8}{:>9}{:>10}{:>10}{:>10}{:>8}{:>8}{:>8}{:>9}{:>9}{:>9}{:>8}{:>9}{:>8}{:>10}{:>9}",
        c.system.name(),
        c.count,
        c.opened,
        c.failed,
        c.not_attempted,
        opt(p50, 0),
        opt(p99, 0),
        opt(c.server_kib_per_conn, 1),
        opt(c.server_shmem_kib_per_conn, 1),
        opt(c.server_pinned_kib_per_conn, 1),
        opt(c.server_fds_per_conn, 2),
        opt(c.server_idle.map(|s| s.vm_rss_kib as f64 / 1024.0), 1),
        c.clients_threads,
        opt(c.client_kib_per_conn, 1),
        opt(c.client_pinned_kib_per_conn, 1),
        opt(c.client_fds_per_conn, 2),
        load.map_or("-".into(), |l| l.active.to_string()),
        opt(load.map(|l| l.calls_per_s), 0),
        opt(load.and_then(|l| l.latency).map(|q| q.p50_us), 1),
    )
}

/// The table of a run, with the first error of each failing cell below it.
pub fn table(r: &Report) -> String {
    let mut s = format!(
        "Sessions: one server, one shard; {} client processes; 32 B unary calls; \
         RLIMIT_NOFILE {} (hard {}); rdma-rpc max_connections_per_shard: {}; rdma-rpc \
         client poller: {}\n\n",
        r.config["client_procs"],
        r.nofile.0,
        r.nofile.1,
        r.config["max_connections"]
            .as_u64()
            .map_or("default".into(), |n| n.to_string()),
        r.config["client_poller"].as_str().unwrap_or("thread"),
    );
    s.push_str(&format!(
        "{:<9}{:>7}{:>8}{:>8}{:>9}{:>20}{:>34}{:>9}{:>35}{:>27}\n",
        "",
        "",
        "",
        "",
        "not",
        "connect+1st call",
        "server per connection",
        "server",
        "clients (per connection)",
        if r.config.get("active").is_some_and(|a| !a.is_null()) {
            "active: 32 B calls"
        } else {
            "1% active: 32 B calls"
        }
    ));
    s.push_str(&format!(
        "{:<9}{:>7}{:>8}{:>8}{:>9}{:>10}{:>10}{:>10}{:>8}{:>8}{:>8}{:>9}{:>9}{:>9}{:>8}{:>9}{:>8}{:>10}{:>9}\n",
        "system",
        "conns",
        "opened",
        "failed",
        "tried",
        "p50 µs",
        "p99 µs",
        "KiB",
        "shm KiB",
        "pin KiB",
        "fds",
        "idle MiB",
        "threads",
        "KiB",
        "pin KiB",
        "fds",
        "active",
        "calls/s",
        "p50 µs"
    ));
    for c in &r.cells {
        s.push_str(&row(c));
        s.push('\n');
    }
    s.push_str(
        "\nKiB: server VmRSS (it includes RssShmem, the soft RNIC's shared memory) with all \
         connections open and idle, minus the server with none, over the connections opened; \
         shm KiB: the RssShmem part; pin KiB: the same for memory pinned for the device \
         (VmPin + VmLck: the ib provider's registered memory; the soft provider pins none); \
         fds: the same for /proc/PID/fd. idle MiB: the server's VmRSS with no connection. \
         clients: threads of all client processes together; KiB, pin KiB and fds: their \
         VmRSS, pinned memory and descriptors after opening minus before their first \
         connection, over the connections opened.\n",
    );
    let errors: Vec<&Cell> = r.cells.iter().filter(|c| c.first_error.is_some()).collect();
    if !errors.is_empty() {
        s.push_str("\nFirst error of each cell that had failures:\n");
        for c in errors {
            s.push_str(&format!(
                "  {} x {}: {}\n",
                c.system.name(),
                c.count,
                c.first_error.as_deref().unwrap_or_default()
            ));
        }
    }
    for c in &r.cells {
        if let Some(e) = c.load.as_ref().and_then(|l| l.first_error.as_deref()) {
            s.push_str(&format!(
                "  {} x {} load phase: {} failed calls; first: {e}\n",
                c.system.name(),
                c.count,
                c.load.as_ref().map_or(0, |l| l.errors)
            ));
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let s = ProcStatus::read(std::process::id()).unwrap();
        assert!(s.vm_rss_kib > 0);
        assert!(s.vm_rss_kib >= s.rss_anon_kib);
        assert!(s.threads >= 1);
        // stdin, stdout, stderr at least (or what the test runner left open).
        assert!(s.fds >= 1);
        assert!(ProcStatus::read(u32::MAX).is_none());
    }
}
