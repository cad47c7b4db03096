//! Figures: one cell per (repetition, size, system), medians over repetitions, ratios, the
//! targets of issues 3 and 6, the table and the JSON file.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::measure::{LatencyRun, Machine, Plan, RateRun};

/// A system under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum System {
    /// (a) rdma-rpc.
    Rpc,
    /// (a') rdma-rpc with default options only: large payloads from ordinary memory (no
    /// `Channel::alloc_bytes`) and no response size hint. Measured from 16 KiB on (below that
    /// it is the same as `Rpc`).
    RpcPlain,
    /// (a'') rdma-rpc's default async call: a task on a two-worker tokio runtime awaiting the
    /// generated client's call, on a channel with the default poller thread (one outstanding;
    /// many outstanding: that many tasks). Measured at 32 B only.
    RpcAsync,
    /// (b) tonic, current-thread runtimes.
    TonicCt,
    /// (b) tonic, multi-thread runtimes.
    TonicMt,
    /// (c) the raw provider's SEND/RECV ping-pong.
    Raw,
}

impl System {
    /// Name in tables and plots.
    pub fn name(self) -> &'static str {
        match self {
            System::Rpc => "rdma-rpc",
            System::RpcPlain => "rpc-plain",
            System::RpcAsync => "rpc-async",
            System::TonicCt => "tonic-ct",
            System::TonicMt => "tonic-mt",
            System::Raw => "raw",
        }
    }

    /// Whether it is a tonic configuration.
    pub fn is_tonic(self) -> bool {
        matches!(self, System::TonicCt | System::TonicMt)
    }
}

/// One-outstanding figures of one cell.
#[derive(Clone, Debug, Serialize)]
pub struct LatencyFig {
    /// Calls timed.
    pub calls: u64,
    /// Round-trip latency percentiles and mean, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Mean, µs.
    pub mean_us: f64,
    /// Largest, µs.
    pub max_us: f64,
    /// Calls per second with one outstanding.
    pub calls_per_s: f64,
    /// Request plus response payload bytes per second, GB/s (10^9).
    pub goodput_gbps: f64,
    /// User + system CPU time of both processes per call, µs.
    pub cpu_us_per_call: f64,
    /// The client's share, µs.
    pub client_cpu_us_per_call: f64,
    /// The server's share, µs.
    pub server_cpu_us_per_call: f64,
    /// Payload bytes the soft RNICs of both processes copied per call (0 for tonic and for
    /// providers that do not count).
    pub nic_bytes_per_call: f64,
    /// Work requests the soft RNICs of both processes executed per call.
    pub nic_ops_per_call: f64,
}

impl LatencyFig {
    /// Figures of a run of `size`-byte calls.
    pub fn from_run(size: usize, r: &LatencyRun) -> LatencyFig {
        let us = |ns: u64| ns as f64 / 1000.0;
        let secs = r.wall.as_secs_f64().max(1e-9);
        let calls = r.calls.max(1) as f64;
        let per_call = |d: std::time::Duration| d.as_secs_f64() * 1e6 / calls;
        LatencyFig {
            calls: r.calls,
            p50_us: us(r.hist.value_at_quantile(0.5)),
            p99_us: us(r.hist.value_at_quantile(0.99)),
            p999_us: us(r.hist.value_at_quantile(0.999)),
            mean_us: r.hist.mean() / 1000.0,
            max_us: us(r.hist.max()),
            calls_per_s: r.calls as f64 / secs,
            goodput_gbps: 2.0 * size as f64 * r.calls as f64 / secs / 1e9,
            cpu_us_per_call: per_call(r.cpu.client.total() + r.cpu.server.total()),
            client_cpu_us_per_call: per_call(r.cpu.client.total()),
            server_cpu_us_per_call: per_call(r.cpu.server.total()),
            nic_bytes_per_call: r.cpu.nic_bytes as f64 / calls,
            nic_ops_per_call: r.cpu.nic_ops as f64 / calls,
        }
    }
}

/// Many-outstanding figures of one cell.
#[derive(Clone, Debug, Serialize)]
pub struct RateFig {
    /// Calls in flight.
    pub outstanding: usize,
    /// Calls counted.
    pub calls: u64,
    /// Seconds timed.
    pub secs: f64,
    /// Calls per second.
    pub calls_per_s: f64,
    /// Request plus response payload bytes per second, GB/s.
    pub goodput_gbps: f64,
    /// CPU time of both processes per call, µs.
    pub cpu_us_per_call: f64,
}

impl RateFig {
    /// Figures of a run of `size`-byte calls with `outstanding` in flight.
    pub fn from_run(size: usize, outstanding: usize, r: &RateRun) -> RateFig {
        let secs = r.wall.as_secs_f64().max(1e-9);
        RateFig {
            outstanding,
            calls: r.calls,
            secs,
            calls_per_s: r.calls as f64 / secs,
            goodput_gbps: 2.0 * size as f64 * r.calls as f64 / secs / 1e9,
            cpu_us_per_call: (r.cpu.client.total() + r.cpu.server.total()).as_secs_f64() * 1e6
                / r.calls.max(1) as f64,
        }
    }
}

/// One measured cell.
#[derive(Clone, Debug, Serialize)]
pub struct Cell {
    /// Repetition (0-based).
    pub rep: usize,
    /// System.
    pub system: System,
    /// Payload bytes each way.
    pub size: usize,
    /// 1-minute load average when the cell started.
    pub load1: Option<f64>,
    /// One outstanding.
    pub latency: Option<LatencyFig>,
    /// Many outstanding.
    pub rates: Vec<RateFig>,
    /// Outstanding counts skipped because `outstanding * size` exceeds the in-flight limit.
    pub skipped: Vec<usize>,
    /// What failed, if anything.
    pub error: Option<String>,
    /// Wall seconds the cell took, server start and stop included.
    pub secs: f64,
}

/// Medians over repetitions for one (system, size).
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    /// System.
    pub system: System,
    /// Payload bytes each way.
    pub size: usize,
    /// Repetitions that succeeded.
    pub reps: usize,
    /// Median p50, µs.
    pub p50_us: Option<f64>,
    /// Median p99, µs.
    pub p99_us: Option<f64>,
    /// Median p99.9, µs.
    pub p999_us: Option<f64>,
    /// Median mean, µs.
    pub mean_us: Option<f64>,
    /// Smallest and largest p50 over repetitions, µs.
    pub p50_range_us: Option<(f64, f64)>,
    /// Median calls/s and goodput and CPU per call at each outstanding count (1 = the
    /// latency phase).
    pub rates: BTreeMap<usize, RateSummary>,
    /// Median CPU µs per call with one outstanding.
    pub cpu_us_per_call: Option<f64>,
    /// Median soft RNIC payload bytes copied per call, one outstanding.
    pub nic_bytes_per_call: Option<f64>,
    /// Median soft RNIC work requests per call, one outstanding.
    pub nic_ops_per_call: Option<f64>,
}

/// Medians at one outstanding count.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct RateSummary {
    /// Calls per second.
    pub calls_per_s: f64,
    /// Request plus response payload bytes per second, GB/s.
    pub goodput_gbps: f64,
    /// CPU µs per call, both processes.
    pub cpu_us_per_call: f64,
}

/// The median of `v` (mean of the middle two for an even count); `None` when empty.
pub fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Medians per (system, size) over the cells.
pub fn summarize(cells: &[Cell]) -> Vec<Row> {
    let mut keys: Vec<(usize, System)> = cells.iter().map(|c| (c.size, c.system)).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .map(|(size, system)| {
            let ok: Vec<&Cell> = cells
                .iter()
                .filter(|c| c.size == size && c.system == system && c.error.is_none())
                .collect();
            let lat: Vec<&LatencyFig> = ok.iter().filter_map(|c| c.latency.as_ref()).collect();
            let m = |f: fn(&LatencyFig) -> f64| median(lat.iter().map(|l| f(l)).collect());
            let p50s: Vec<f64> = lat.iter().map(|l| l.p50_us).collect();
            let p50_range = p50s
                .iter()
                .copied()
                .fold(None, |acc: Option<(f64, f64)>, x| {
                    Some(acc.map_or((x, x), |(lo, hi)| (lo.min(x), hi.max(x))))
                });
            let mut rates = BTreeMap::new();
            if !lat.is_empty() {
                rates.insert(
                    1,
                    RateSummary {
                        calls_per_s: m(|l| l.calls_per_s).unwrap_or(0.0),
                        goodput_gbps: m(|l| l.goodput_gbps).unwrap_or(0.0),
                        cpu_us_per_call: m(|l| l.cpu_us_per_call).unwrap_or(0.0),
                    },
                );
            }
            let mut ks: Vec<usize> = ok
                .iter()
                .flat_map(|c| c.rates.iter().map(|r| r.outstanding))
                .collect();
            ks.sort_unstable();
            ks.dedup();
            for k in ks {
                let rs: Vec<&RateFig> = ok
                    .iter()
                    .flat_map(|c| c.rates.iter().filter(move |r| r.outstanding == k))
                    .collect();
                let mr = |f: fn(&RateFig) -> f64| {
                    median(rs.iter().map(|r| f(r)).collect()).unwrap_or(0.0)
                };
                rates.insert(
                    k,
                    RateSummary {
                        calls_per_s: mr(|r| r.calls_per_s),
                        goodput_gbps: mr(|r| r.goodput_gbps),
                        cpu_us_per_call: mr(|r| r.cpu_us_per_call),
                    },
                );
            }
            Row {
                system,
                size,
                reps: ok.len(),
                p50_us: m(|l| l.p50_us),
                p99_us: m(|l| l.p99_us),
                p999_us: m(|l| l.p999_us),
                mean_us: m(|l| l.mean_us),
                p50_range_us: p50_range,
                rates,
                cpu_us_per_call: m(|l| l.cpu_us_per_call),
                nic_bytes_per_call: m(|l| l.nic_bytes_per_call),
                nic_ops_per_call: m(|l| l.nic_ops_per_call),
            }
        })
        .collect()
}

/// rdma-rpc against the best tonic configuration for one size: every figure as "how many
/// times better" (tonic / rdma-rpc for times, rdma-rpc / tonic for rates).
#[derive(Clone, Debug, Serialize)]
pub struct Ratio {
    /// Payload bytes each way.
    pub size: usize,
    /// p50: tonic / rdma-rpc.
    pub p50: Option<f64>,
    /// p99: tonic / rdma-rpc.
    pub p99: Option<f64>,
    /// p99.9: tonic / rdma-rpc.
    pub p999: Option<f64>,
    /// Mean: tonic / rdma-rpc.
    pub mean: Option<f64>,
    /// Calls/s (and goodput) at each outstanding count: rdma-rpc / tonic.
    pub rate: BTreeMap<usize, f64>,
    /// CPU per call with one outstanding: tonic / rdma-rpc.
    pub cpu: Option<f64>,
    /// Which tonic configuration was best, per figure.
    pub best_tonic: BTreeMap<String, System>,
    /// rdma-rpc p50 / raw provider p50 (the framework's overhead factor).
    pub rpc_over_raw_p50: Option<f64>,
}

fn best_tonic(
    rows: &[&Row],
    f: impl Fn(&Row) -> Option<f64>,
    lower_is_better: bool,
) -> Option<(f64, System)> {
    rows.iter()
        .filter(|r| r.system.is_tonic())
        .filter_map(|r| f(r).map(|v| (v, r.system)))
        .reduce(|a, b| {
            let better = if lower_is_better {
                b.0 < a.0
            } else {
                b.0 > a.0
            };
            if better { b } else { a }
        })
}

/// Ratios for every size that has rdma-rpc and tonic rows.
pub fn ratios(rows: &[Row]) -> Vec<Ratio> {
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.dedup();
    let mut out = Vec::new();
    for size in sizes {
        let here: Vec<&Row> = rows.iter().filter(|r| r.size == size).collect();
        let Some(rpc) = here.iter().find(|r| r.system == System::Rpc) else {
            continue;
        };
        let raw = here.iter().find(|r| r.system == System::Raw);
        let mut best = BTreeMap::new();
        let mut time = |name: &str, f: fn(&Row) -> Option<f64>| {
            let (t, sys) = best_tonic(&here, f, true)?;
            best.insert(name.to_string(), sys);
            Some(t / f(rpc)?)
        };
        let p50 = time("p50", |r| r.p50_us);
        let p99 = time("p99", |r| r.p99_us);
        let p999 = time("p999", |r| r.p999_us);
        let mean = time("mean", |r| r.mean_us);
        let cpu = time("cpu", |r| r.cpu_us_per_call);
        let mut rate = BTreeMap::new();
        for (&k, s) in &rpc.rates {
            if let Some((t, sys)) =
                best_tonic(&here, |r| r.rates.get(&k).map(|x| x.calls_per_s), false)
            {
                best.insert(format!("calls_per_s@{k}"), sys);
                rate.insert(k, s.calls_per_s / t);
            }
        }
        out.push(Ratio {
            size,
            p50,
            p99,
            p999,
            mean,
            rate,
            cpu,
            best_tonic: best,
            rpc_over_raw_p50: raw.and_then(|r| Some(rpc.p50_us? / r.p50_us?)),
        });
    }
    out
}

/// One target of an issue and how the run did against it.
#[derive(Clone, Debug, Serialize)]
pub struct Target {
    /// Issue number.
    pub issue: u32,
    /// What is asked.
    pub what: String,
    /// The measured value (in the target's unit).
    pub measured: Option<f64>,
    /// The bound.
    pub bound: f64,
    /// Whether the measured value must be at least (true) or at most (false) the bound.
    pub at_least: bool,
    /// Whether it was met.
    pub met: Option<bool>,
}

impl Target {
    fn new(issue: u32, what: &str, measured: Option<f64>, bound: f64, at_least: bool) -> Target {
        Target {
            issue,
            what: what.to_string(),
            measured,
            bound,
            at_least,
            met: measured.map(|m| if at_least { m >= bound } else { m <= bound }),
        }
    }
}

/// The issue-3 figures: measured in the same run, on rdma-rpc only.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Issue3 {
    /// 32 B p50 and p99 with one outstanding, µs (from the 32 B rdma-rpc row).
    pub p50_us: Option<f64>,
    /// As above, p99.
    pub p99_us: Option<f64>,
    /// Median calls/s with 32 outstanding from one client thread, one shard.
    pub calls_per_s_32: Option<f64>,
    /// Median 4 MiB echo goodput (request + response payload), GB/s, best of the outstanding
    /// counts measured.
    pub goodput_4mib_gbps: Option<f64>,
    /// Median single-thread memcpy bandwidth of 4 MiB copies, GB/s.
    pub memcpy_4mib_gbps: Option<f64>,
}

/// `f` of `system`'s row over `f` of rdma-rpc's row at `size`.
fn plain_of(rows: &[Row], size: usize, system: System, f: fn(&Row) -> Option<f64>) -> Option<f64> {
    let of = |sys: System| rows.iter().find(|r| r.size == size && r.system == sys);
    match (of(system).and_then(f), of(System::Rpc).and_then(f)) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    }
}

/// Every target with its verdict.
pub fn targets(rows: &[Row], ratios: &[Ratio], i3: &Issue3) -> Vec<Target> {
    let r32 = ratios.iter().find(|r| r.size == 32);
    let r16 = ratios.iter().find(|r| r.size == 16 << 20);
    let goodput16 = |sys: fn(System) -> bool| {
        rows.iter()
            .filter(|r| r.size == 16 << 20 && sys(r.system))
            .flat_map(|r| r.rates.values().map(|s| s.goodput_gbps))
            .reduce(f64::max)
    };
    let g16 = match (goodput16(|s| s == System::Rpc), goodput16(System::is_tonic)) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let _ = r16;
    // Issue 16 items 1 and 5: the default async call and default options against rdma-rpc's
    // row (blocking calls, opt-ins), same run.
    let plain = |size: usize, f: fn(&Row) -> Option<f64>| plain_of(rows, size, System::RpcPlain, f);
    let mut out = vec![
        Target::new(3, "32 B, 1 outstanding: p50 (µs)", i3.p50_us, 3.0, false),
        Target::new(3, "32 B, 1 outstanding: p99 (µs)", i3.p99_us, 10.0, false),
        Target::new(
            3,
            "32 B, 32 outstanding, one client thread: calls/s",
            i3.calls_per_s_32,
            1.5e6,
            true,
        ),
        Target::new(
            3,
            "4 MiB echo goodput / memcpy bandwidth",
            match (i3.goodput_4mib_gbps, i3.memcpy_4mib_gbps) {
                (Some(g), Some(m)) if m > 0.0 => Some(g / m),
                _ => None,
            },
            0.4,
            true,
        ),
        Target::new(
            6,
            "32 B p50: tonic / rdma-rpc",
            r32.and_then(|r| r.p50),
            50.0,
            true,
        ),
        Target::new(
            6,
            "32 B p99: tonic / rdma-rpc",
            r32.and_then(|r| r.p99),
            30.0,
            true,
        ),
        Target::new(
            6,
            "32 B calls/s at 64 outstanding: rdma-rpc / tonic",
            r32.and_then(|r| r.rate.get(&64).copied()),
            20.0,
            true,
        ),
        Target::new(
            6,
            "16 MiB goodput (best outstanding): rdma-rpc / tonic",
            g16,
            5.0,
            true,
        ),
        Target::new(
            6,
            "32 B p50: rdma-rpc / raw provider",
            r32.and_then(|r| r.rpc_over_raw_p50),
            3.0,
            false,
        ),
    ];
    if let Some(x) = plain_of(rows, 32, System::RpcAsync, |r| r.p50_us) {
        out.push(Target::new(
            16,
            "32 B p50: rpc-async / rdma-rpc (blocking)",
            Some(x),
            1.5,
            false,
        ));
    }
    for (size, name) in [(1 << 20, "1 MiB"), (16 << 20, "16 MiB")] {
        if rows
            .iter()
            .any(|r| r.size == size && r.system == System::RpcPlain)
        {
            out.push(Target::new(
                16,
                &format!("{name} p50: rpc-plain / rdma-rpc (opt-ins)"),
                plain(size, |r| r.p50_us),
                1.2,
                false,
            ));
        }
    }
    out
}

/// Everything a run produced: what the JSON file holds.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// The command line.
    pub command: String,
    /// The client's machine.
    pub machine: Machine,
    /// The server host's machine, as it describes itself.
    pub server_machine: String,
    /// Unix time the run started.
    pub started_unix: u64,
    /// Wall seconds the run took.
    pub seconds: f64,
    /// Load average (1, 5, 15 min) before and after.
    pub load_before: Option<[f64; 3]>,
    /// After.
    pub load_after: Option<[f64; 3]>,
    /// Settings.
    pub config: serde_json::Value,
    /// Phase lengths.
    pub plan: Plan,
    /// Medians per system and size.
    pub rows: Vec<Row>,
    /// rdma-rpc against the best tonic, per size.
    pub ratios: Vec<Ratio>,
    /// Issue 3's figures.
    pub issue3: Issue3,
    /// Targets and verdicts.
    pub targets: Vec<Target>,
    /// Streaming figures (issue 7), when measured.
    pub streaming: Option<crate::stream_report::StreamReport>,
    /// Every cell of every repetition.
    pub cells: Vec<Cell>,
    /// Cells that failed.
    pub errors: Vec<String>,
}

/// `1536` -> `1.5 KiB`; powers of two print exactly.
pub fn size_name(n: usize) -> String {
    const UNITS: [(&str, usize); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (u, v) in UNITS {
        if n >= v {
            return if n.is_multiple_of(v) {
                format!("{} {u}", n / v)
            } else {
                format!("{:.1} {u}", n as f64 / v as f64)
            };
        }
    }
    format!("{n} B")
}

fn num(v: Option<f64>) -> String {
    match v {
        None => "-".into(),
        Some(x) if x >= 1e6 => format!("{:.2}M", x / 1e6),
        Some(x) if x >= 1e4 => format!("{:.0}k", x / 1e3),
        Some(x) if x >= 100.0 => format!("{x:.0}"),
        Some(x) if x >= 10.0 => format!("{x:.1}"),
        Some(x) => format!("{x:.2}"),
    }
}

fn times(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| {
        if x >= 100.0 {
            format!("{x:.0}x")
        } else {
            format!("{x:.1}x")
        }
    })
}

/// The table printed on stdout.
pub fn table(report: &Report, ks: &[usize], large_from: usize) -> String {
    let mut s = String::new();
    let raw_name = format!(
        "raw-{}",
        report.config["provider"].as_str().unwrap_or("soft")
    );
    let _ = writeln!(
        s,
        "Round-trip latency (µs) with 1 call outstanding; calls/s at 1/{} outstanding; goodput = \
         (request + response payload) / time; CPU = user + sys of both processes per call.",
        ks.iter()
            .map(usize::to_string)
            .collect::<Vec<_>>()
            .join("/")
    );
    let _ = writeln!(
        s,
        "Medians of {} interleaved repetitions. Ratio row: how many times better rdma-rpc is \
         than the best tonic configuration (tonic/rdma-rpc for times, rdma-rpc/tonic for rates).",
        report.config["reps"]
    );
    if report.rows.iter().any(|r| r.system == System::RpcAsync) {
        let _ = writeln!(
            s,
            "rpc-async: rdma-rpc's default async call (a task on a two-worker runtime, the \
             default poller thread); rdma-rpc's one-outstanding figures are blocking calls."
        );
    }
    if report.rows.iter().any(|r| r.system == System::RpcPlain) {
        let _ = writeln!(
            s,
            "rpc-plain: rdma-rpc with default options (payloads in ordinary memory, no \
             Channel::alloc_bytes; no response size hint); rdma-rpc uses both from 16 KiB."
        );
    }
    if let Some(n) = report.config["background_load"].as_u64().filter(|&n| n > 0) {
        let _ = writeln!(
            s,
            "Background load: {n} busy thread{} (not pinned) spinning through every phase of \
             every system: a shared host.",
            if n == 1 { "" } else { "s" }
        );
    }
    let mut head = format!(
        "{:<8} {:<9} {:>8} {:>8} {:>8} {:>8}",
        "size", "system", "p50", "p99", "p99.9", "mean"
    );
    let mut all_k: Vec<usize> = std::iter::once(1).chain(ks.iter().copied()).collect();
    all_k.sort_unstable();
    all_k.dedup();
    for k in &all_k {
        let _ = write!(head, " {:>9}", format!("calls/s@{k}"));
    }
    let _ = write!(head, " {:>10} {:>10}", "GB/s@1", "GB/s@best");
    let _ = write!(head, " {:>9}", "CPU µs@1");
    let _ = writeln!(s, "{head}");
    let _ = writeln!(s, "{}", "-".repeat(head.chars().count()));
    let mut sizes: Vec<usize> = report.rows.iter().map(|r| r.size).collect();
    sizes.dedup();
    for size in sizes {
        for row in report.rows.iter().filter(|r| r.size == size) {
            let name = if row.system == System::Raw {
                raw_name.as_str()
            } else {
                row.system.name()
            };
            let mut line = format!(
                "{:<8} {:<9} {:>8} {:>8} {:>8} {:>8}",
                size_name(size),
                name,
                num(row.p50_us),
                num(row.p99_us),
                num(row.p999_us),
                num(row.mean_us)
            );
            for k in &all_k {
                let _ = write!(line, " {:>9}", num(row.rates.get(k).map(|r| r.calls_per_s)));
            }
            let best = row.rates.values().map(|r| r.goodput_gbps).reduce(f64::max);
            let (g1, gb) = if size >= large_from {
                (row.rates.get(&1).map(|r| r.goodput_gbps), best)
            } else {
                (None, None)
            };
            let _ = write!(line, " {:>10} {:>10}", num(g1), num(gb));
            let _ = write!(line, " {:>9}", num(row.cpu_us_per_call));
            let _ = writeln!(s, "{line}");
        }
        if let Some(r) = report.ratios.iter().find(|r| r.size == size) {
            let mut line = format!(
                "{:<8} {:<9} {:>8} {:>8} {:>8} {:>8}",
                "",
                "ratio",
                times(r.p50),
                times(r.p99),
                times(r.p999),
                times(r.mean)
            );
            for k in &all_k {
                let _ = write!(line, " {:>9}", times(r.rate.get(k).copied()));
            }
            let _ = write!(line, " {:>10} {:>10} {:>9}", "", "", times(r.cpu));
            if let Some(x) = r.rpc_over_raw_p50 {
                let _ = write!(line, "   rdma-rpc p50 = {x:.1}x raw");
            }
            let _ = writeln!(s, "{line}");
        }
        let _ = writeln!(s);
    }
    let nic: Vec<&Row> = report
        .rows
        .iter()
        .filter(|r| !r.system.is_tonic() && r.nic_ops_per_call.is_some_and(|o| o > 0.0))
        .collect();
    if !nic.is_empty() {
        let _ = writeln!(
            s,
            "Soft RNIC work per call, 1 outstanding (counted by the provider in both processes): \
             work requests, and payload bytes it copied / (request + response payload):"
        );
        for r in nic {
            let name = if r.system == System::Raw {
                raw_name.as_str()
            } else {
                r.system.name()
            };
            let _ = writeln!(
                s,
                "  {:<8} {:<9} {:>6} WRs {:>6} x",
                size_name(r.size),
                name,
                num(r.nic_ops_per_call),
                num(r.nic_bytes_per_call.map(|b| b / (2.0 * r.size as f64)))
            );
        }
        let _ = writeln!(s);
    }
    let mut wins: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &report.ratios {
        for sys in r.best_tonic.values() {
            *wins.entry(sys.name()).or_default() += 1;
        }
    }
    if !wins.is_empty() {
        let list: Vec<String> = wins.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            s,
            "Best tonic configuration per figure (figures won): {}\n",
            list.join(", ")
        );
    }
    let i3 = &report.issue3;
    let _ = writeln!(s, "Issue 3 (rdma-rpc alone, same run):");
    let _ = writeln!(
        s,
        "  32 B, 1 outstanding (blocking call, caller polls, busy shard): p50 {} µs, p99 {} µs",
        num(i3.p50_us),
        num(i3.p99_us)
    );
    let _ = writeln!(
        s,
        "  32 B, 32 outstanding from one client thread, one shard: {} calls/s",
        num(i3.calls_per_s_32)
    );
    let _ = writeln!(
        s,
        "  4 MiB echo: {} GB/s (request + response payload), single-thread memcpy of 4 MiB: {} \
         GB/s",
        num(i3.goodput_4mib_gbps),
        num(i3.memcpy_4mib_gbps)
    );
    let _ = writeln!(s, "\nTargets:");
    for t in &report.targets {
        let verdict = match t.met {
            Some(true) => "met",
            Some(false) => "NOT MET",
            None => "not measured",
        };
        let _ = writeln!(
            s,
            "  issue {}: {:<52} {:>10} ({} {}) {verdict}",
            t.issue,
            t.what,
            num(t.measured),
            if t.at_least { ">=" } else { "<=" },
            num(Some(t.bound))
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_even_and_empty() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(median(vec![]), None);
    }

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(size_name(32), "32 B");
        assert_eq!(size_name(4096), "4 KiB");
        assert_eq!(size_name(16 << 20), "16 MiB");
        assert_eq!(size_name(1536), "1.5 KiB");
    }

    fn row(system: System, p50: f64, rate64: f64) -> Row {
        let mut rates = BTreeMap::new();
        rates.insert(
            64,
            RateSummary {
                calls_per_s: rate64,
                goodput_gbps: 0.0,
                cpu_us_per_call: 1.0,
            },
        );
        Row {
            system,
            size: 32,
            reps: 1,
            p50_us: Some(p50),
            p99_us: Some(p50 * 2.0),
            p999_us: None,
            mean_us: Some(p50),
            p50_range_us: None,
            rates,
            cpu_us_per_call: Some(1.0),
            nic_bytes_per_call: None,
            nic_ops_per_call: None,
        }
    }

    #[test]
    fn ratios_use_the_best_tonic_per_figure() {
        let rows = vec![
            row(System::Rpc, 2.0, 1e6),
            row(System::TonicCt, 100.0, 2e4),
            row(System::TonicMt, 150.0, 5e4),
            row(System::Raw, 1.0, 3e6),
        ];
        let r = &ratios(&rows)[0];
        assert_eq!(r.p50, Some(50.0));
        assert_eq!(r.best_tonic["p50"], System::TonicCt);
        assert_eq!(r.rate[&64], 20.0);
        assert_eq!(r.best_tonic["calls_per_s@64"], System::TonicMt);
        assert_eq!(r.rpc_over_raw_p50, Some(2.0));
        assert_eq!(r.p999, None);
        let t = targets(&rows, std::slice::from_ref(r), &Issue3::default());
        let p50 = t
            .iter()
            .find(|t| t.what.starts_with("32 B p50: tonic"))
            .unwrap();
        assert_eq!(p50.met, Some(true));
        let raw = t.iter().find(|t| t.what.contains("raw")).unwrap();
        assert_eq!(raw.met, Some(true));
        assert!(t.iter().any(|t| t.met.is_none()));
    }
}
