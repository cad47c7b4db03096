//! Streaming figures (issue 7): one cell per (repetition, size, system), medians over the
//! repetitions, ratios against the best tonic configuration, and their table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::Serialize;

use crate::report::{LatencyFig, System, median, size_name};
use crate::stream::StreamRun;

/// A throughput phase of one streaming cell.
#[derive(Clone, Debug, Serialize)]
pub struct StreamFig {
    /// Messages outstanding on the call (pipelined bidi); for server streaming, 0: the server
    /// sends as fast as the stream's flow control lets it.
    pub in_flight: usize,
    /// Messages (replies) counted.
    pub messages: u64,
    /// Calls they came on.
    pub calls: u64,
    /// Seconds timed.
    pub secs: f64,
    /// Messages per second.
    pub msgs_per_s: f64,
    /// Payload bytes per second, GB/s (10^9): the replies' for server streaming, requests'
    /// and replies' for bidi.
    pub goodput_gbps: f64,
    /// User + system CPU time of both processes per message (reply), µs.
    pub cpu_us_per_msg: f64,
    /// Work requests the soft RNICs of both processes executed per message (0 for tonic and
    /// for providers that do not count).
    pub nic_ops_per_msg: f64,
    /// Payload bytes the soft RNICs of both processes copied per message.
    pub nic_bytes_per_msg: f64,
}

impl StreamFig {
    /// Figures of a run of `size`-byte messages; `ways` is 1 for server streaming (payload
    /// one way), 2 for bidi (each reply answers a request of the same size).
    pub fn from_run(size: usize, ways: u32, in_flight: usize, r: &StreamRun) -> StreamFig {
        let secs = r.wall.as_secs_f64().max(1e-9);
        StreamFig {
            in_flight,
            messages: r.messages,
            calls: r.calls,
            secs,
            msgs_per_s: r.messages as f64 / secs,
            goodput_gbps: f64::from(ways) * size as f64 * r.messages as f64 / secs / 1e9,
            cpu_us_per_msg: (r.cpu.client.total() + r.cpu.server.total()).as_secs_f64() * 1e6
                / r.messages.max(1) as f64,
            nic_ops_per_msg: r.cpu.nic_ops as f64 / r.messages.max(1) as f64,
            nic_bytes_per_msg: r.cpu.nic_bytes as f64 / r.messages.max(1) as f64,
        }
    }
}

/// One measured streaming cell: one server process, one connection, the three phases.
#[derive(Clone, Debug, Serialize)]
pub struct StreamCell {
    /// Repetition (0-based).
    pub rep: usize,
    /// System.
    pub system: System,
    /// Payload bytes of each message.
    pub size: usize,
    /// 1-minute load average when the cell started.
    pub load1: Option<f64>,
    /// Ping-pong on one bidi call: round trips per message (`calls` counts messages).
    pub ping_pong: Option<LatencyFig>,
    /// Server streaming.
    pub server_stream: Option<StreamFig>,
    /// Pipelined bidi.
    pub bidi: Option<StreamFig>,
    /// Phases not run, and why.
    pub skipped: Vec<String>,
    /// What failed, if anything.
    pub error: Option<String>,
    /// Wall seconds the cell took, server start and stop included.
    pub secs: f64,
}

/// Medians of a throughput phase.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct StreamRateSummary {
    /// Messages per second.
    pub msgs_per_s: f64,
    /// Payload GB/s (as [`StreamFig::goodput_gbps`]).
    pub goodput_gbps: f64,
    /// CPU µs per message, both processes.
    pub cpu_us_per_msg: f64,
    /// Soft RNIC work requests per message, both processes.
    pub nic_ops_per_msg: f64,
}

/// Medians over repetitions for one (system, size).
#[derive(Clone, Debug, Serialize)]
pub struct StreamRow {
    /// System.
    pub system: System,
    /// Payload bytes of each message.
    pub size: usize,
    /// Repetitions that succeeded.
    pub reps: usize,
    /// Ping-pong round trip per message: median p50, µs.
    pub p50_us: Option<f64>,
    /// Median p99, µs.
    pub p99_us: Option<f64>,
    /// Median p99.9, µs.
    pub p999_us: Option<f64>,
    /// Median mean, µs.
    pub mean_us: Option<f64>,
    /// Smallest and largest ping-pong p50 over repetitions, µs.
    pub p50_range_us: Option<(f64, f64)>,
    /// Ping-pong messages per second.
    pub ping_pong_msgs_per_s: Option<f64>,
    /// Ping-pong CPU µs per message, both processes.
    pub ping_pong_cpu_us: Option<f64>,
    /// Server streaming.
    pub server_stream: Option<StreamRateSummary>,
    /// Pipelined bidi.
    pub bidi: Option<StreamRateSummary>,
    /// Messages in flight of the pipelined bidi phase.
    pub bidi_in_flight: Option<usize>,
}

fn summarize_rates(figs: &[&StreamFig]) -> Option<StreamRateSummary> {
    if figs.is_empty() {
        return None;
    }
    let m = |f: fn(&StreamFig) -> f64| median(figs.iter().map(|x| f(x)).collect()).unwrap_or(0.0);
    Some(StreamRateSummary {
        msgs_per_s: m(|x| x.msgs_per_s),
        goodput_gbps: m(|x| x.goodput_gbps),
        cpu_us_per_msg: m(|x| x.cpu_us_per_msg),
        nic_ops_per_msg: m(|x| x.nic_ops_per_msg),
    })
}

/// Medians per (system, size) over the cells that did not fail.
pub fn summarize(cells: &[StreamCell]) -> Vec<StreamRow> {
    let mut keys: Vec<(usize, System)> = cells.iter().map(|c| (c.size, c.system)).collect();
    keys.sort();
    keys.dedup();
    keys.into_iter()
        .map(|(size, system)| {
            let ok: Vec<&StreamCell> = cells
                .iter()
                .filter(|c| c.size == size && c.system == system && c.error.is_none())
                .collect();
            let lat: Vec<&LatencyFig> = ok.iter().filter_map(|c| c.ping_pong.as_ref()).collect();
            let m = |f: fn(&LatencyFig) -> f64| median(lat.iter().map(|l| f(l)).collect());
            let p50_range = lat.iter().map(|l| l.p50_us).fold(None, |acc, x| {
                Some(acc.map_or((x, x), |(lo, hi): (f64, f64)| (lo.min(x), hi.max(x))))
            });
            let streams: Vec<&StreamFig> =
                ok.iter().filter_map(|c| c.server_stream.as_ref()).collect();
            let bidis: Vec<&StreamFig> = ok.iter().filter_map(|c| c.bidi.as_ref()).collect();
            StreamRow {
                system,
                size,
                reps: ok.len(),
                p50_us: m(|l| l.p50_us),
                p99_us: m(|l| l.p99_us),
                p999_us: m(|l| l.p999_us),
                mean_us: m(|l| l.mean_us),
                p50_range_us: p50_range,
                ping_pong_msgs_per_s: m(|l| l.calls_per_s),
                ping_pong_cpu_us: m(|l| l.cpu_us_per_call),
                server_stream: summarize_rates(&streams),
                bidi: summarize_rates(&bidis),
                bidi_in_flight: bidis.first().map(|b| b.in_flight),
            }
        })
        .collect()
}

/// rdma-rpc's streaming against the best tonic configuration for one size, every figure as
/// "how many times better" (tonic / rdma-rpc for times and CPU, rdma-rpc / tonic for rates).
#[derive(Clone, Debug, Serialize)]
pub struct StreamRatio {
    /// Payload bytes of each message.
    pub size: usize,
    /// Ping-pong p50.
    pub p50: Option<f64>,
    /// Ping-pong p99.
    pub p99: Option<f64>,
    /// Ping-pong p99.9.
    pub p999: Option<f64>,
    /// Ping-pong mean.
    pub mean: Option<f64>,
    /// Ping-pong messages/s.
    pub ping_pong_rate: Option<f64>,
    /// Ping-pong CPU per message.
    pub ping_pong_cpu: Option<f64>,
    /// Server-streaming messages/s (and goodput, the same ratio).
    pub server_stream: Option<f64>,
    /// Server-streaming CPU per message.
    pub server_stream_cpu: Option<f64>,
    /// Pipelined bidi messages/s.
    pub bidi: Option<f64>,
    /// Which tonic configuration was best, per figure.
    pub best_tonic: BTreeMap<String, System>,
}

/// Ratios for every size that has rdma-rpc and tonic rows (none for the other sizes).
pub fn ratios(rows: &[StreamRow]) -> Vec<StreamRatio> {
    let mut sizes: Vec<usize> = rows.iter().map(|r| r.size).collect();
    sizes.sort_unstable();
    sizes.dedup();
    let mut out = Vec::new();
    for size in sizes {
        let here: Vec<&StreamRow> = rows.iter().filter(|r| r.size == size).collect();
        let Some(rpc) = here.iter().find(|r| r.system == System::Rpc) else {
            continue;
        };
        if !here.iter().any(|r| r.system.is_tonic()) {
            continue;
        }
        let mut best = BTreeMap::new();
        let mut ratio = |name: &str, f: fn(&StreamRow) -> Option<f64>, lower_better: bool| {
            let (t, sys) = here
                .iter()
                .filter(|r| r.system.is_tonic())
                .filter_map(|r| f(r).map(|v| (v, r.system)))
                .reduce(|a, b| {
                    let b_better = if lower_better { b.0 < a.0 } else { b.0 > a.0 };
                    if b_better { b } else { a }
                })?;
            let ours = f(rpc)?;
            best.insert(name.to_string(), sys);
            if lower_better {
                (ours > 0.0).then(|| t / ours)
            } else {
                (t > 0.0).then(|| ours / t)
            }
        };
        let p50 = ratio("p50", |r| r.p50_us, true);
        let p99 = ratio("p99", |r| r.p99_us, true);
        let p999 = ratio("p999", |r| r.p999_us, true);
        let mean = ratio("mean", |r| r.mean_us, true);
        let ping_pong_rate = ratio("ping_pong_rate", |r| r.ping_pong_msgs_per_s, false);
        let ping_pong_cpu = ratio("ping_pong_cpu", |r| r.ping_pong_cpu_us, true);
        let server_stream = ratio(
            "server_stream",
            |r| r.server_stream.map(|s| s.msgs_per_s),
            false,
        );
        let server_stream_cpu = ratio(
            "server_stream_cpu",
            |r| r.server_stream.map(|s| s.cpu_us_per_msg),
            true,
        );
        let bidi = ratio("bidi", |r| r.bidi.map(|s| s.msgs_per_s), false);
        out.push(StreamRatio {
            size,
            p50,
            p99,
            p999,
            mean,
            ping_pong_rate,
            ping_pong_cpu,
            server_stream,
            server_stream_cpu,
            bidi,
            best_tonic: best,
        });
    }
    out
}

/// The streaming part of a run: what the JSON file's `streaming` holds.
#[derive(Clone, Debug, Serialize)]
pub struct StreamReport {
    /// Message sizes measured.
    pub sizes: Vec<usize>,
    /// Messages in flight of the pipelined bidi phase (0: not run).
    pub pipeline: usize,
    /// Messages per server-streaming call, per size.
    pub messages_per_call: BTreeMap<usize, u32>,
    /// Medians per system and size.
    pub rows: Vec<StreamRow>,
    /// rdma-rpc against the best tonic, per size.
    pub ratios: Vec<StreamRatio>,
    /// Every cell of every repetition.
    pub cells: Vec<StreamCell>,
    /// Cells that failed.
    pub errors: Vec<String>,
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

/// The streaming table, as printed on stdout.
pub fn table(s: &StreamReport, reps: &serde_json::Value, provider: &str) -> String {
    let mut out = String::new();
    let k = s.pipeline;
    let bidi = if k > 0 {
        format!(
            "bidi@{k}: one bidi call with {k} messages in flight (messages/s, GB/s of request + \
             reply payload)"
        )
    } else {
        "no pipelined bidi phase (--stream-pipeline 0)".to_string()
    };
    let _ = writeln!(
        out,
        "Streaming (issue 7), medians of {reps} interleaved repetitions. ping-pong: one bidi \
         call, one message out and its reply back before the next (µs per round trip, \
         messages/s, CPU µs per message); stream: server-streaming calls of many messages \
         (messages/s, GB/s of payload one way, CPU µs per message); {bidi}. Ratio row: how \
         many times better rdma-rpc ({provider}) is than the best tonic configuration."
    );
    let head = format!(
        "{:<8} {:<9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} | {:>9} {:>8} {:>8} | {:>9} {:>8}",
        "size",
        "system",
        "p50",
        "p99",
        "p99.9",
        "mean",
        "msg/s",
        "CPU µs",
        "stream/s",
        "GB/s",
        "CPU µs",
        if k > 0 {
            format!("bidi@{k}/s")
        } else {
            "bidi/s".to_string()
        },
        "GB/s"
    );
    let _ = writeln!(out, "{head}");
    let _ = writeln!(out, "{}", "-".repeat(head.chars().count()));
    for &size in &s.sizes {
        for row in s.rows.iter().filter(|r| r.size == size) {
            let st = row.server_stream;
            let bd = row.bidi;
            let _ = writeln!(
                out,
                "{:<8} {:<9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} | {:>9} {:>8} {:>8} | {:>9} {:>8}",
                size_name(size),
                row.system.name(),
                num(row.p50_us),
                num(row.p99_us),
                num(row.p999_us),
                num(row.mean_us),
                num(row.ping_pong_msgs_per_s),
                num(row.ping_pong_cpu_us),
                num(st.map(|x| x.msgs_per_s)),
                num(st.map(|x| x.goodput_gbps)),
                num(st.map(|x| x.cpu_us_per_msg)),
                num(bd.map(|x| x.msgs_per_s)),
                num(bd.map(|x| x.goodput_gbps)),
            );
        }
        if let Some(r) = s.ratios.iter().find(|r| r.size == size) {
            let _ = writeln!(
                out,
                "{:<8} {:<9} {:>8} {:>8} {:>8} {:>8} {:>9} {:>8} | {:>9} {:>8} {:>8} | {:>9} {:>8}",
                "",
                "ratio",
                times(r.p50),
                times(r.p99),
                times(r.p999),
                times(r.mean),
                times(r.ping_pong_rate),
                times(r.ping_pong_cpu),
                times(r.server_stream),
                "",
                times(r.server_stream_cpu),
                times(r.bidi),
                "",
            );
        }
        let _ = writeln!(out);
    }
    let nic: Vec<&StreamRow> = s
        .rows
        .iter()
        .filter(|r| {
            r.server_stream
                .into_iter()
                .chain(r.bidi)
                .any(|x| x.nic_ops_per_msg > 0.0)
        })
        .collect();
    if !nic.is_empty() {
        let _ = writeln!(
            out,
            "Soft RNIC work requests per streamed message (both processes): server streaming, \
             bidi@{k}:"
        );
        for r in nic {
            let _ = writeln!(
                out,
                "  {:<8} {:<9} {:>6} {:>6}",
                size_name(r.size),
                r.system.name(),
                num(r.server_stream.map(|x| x.nic_ops_per_msg)),
                num(r.bidi.map(|x| x.nic_ops_per_msg)),
            );
        }
    }
    let mut wins: BTreeMap<&str, usize> = BTreeMap::new();
    for r in &s.ratios {
        for sys in r.best_tonic.values() {
            *wins.entry(sys.name()).or_default() += 1;
        }
    }
    if !wins.is_empty() {
        let list: Vec<String> = wins.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            out,
            "Best tonic configuration per streaming figure (figures won): {}",
            list.join(", ")
        );
    }
    for e in &s.errors {
        let _ = writeln!(out, "FAILED: {e}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cell(system: System, size: usize, p50: f64, stream: f64, error: bool) -> StreamCell {
        let fig = |rate: f64| StreamFig {
            in_flight: 8,
            messages: 100,
            calls: 1,
            secs: 1.0,
            msgs_per_s: rate,
            goodput_gbps: rate * size as f64 / 1e9,
            cpu_us_per_msg: 2.0,
            nic_ops_per_msg: 0.0,
            nic_bytes_per_msg: 0.0,
        };
        StreamCell {
            rep: 0,
            system,
            size,
            load1: None,
            ping_pong: Some(LatencyFig {
                calls: 10,
                p50_us: p50,
                p99_us: p50 * 2.0,
                p999_us: p50 * 3.0,
                mean_us: p50,
                max_us: p50 * 4.0,
                calls_per_s: 1e6 / p50,
                goodput_gbps: 0.0,
                cpu_us_per_call: p50,
                client_cpu_us_per_call: p50 / 2.0,
                server_cpu_us_per_call: p50 / 2.0,
                nic_bytes_per_call: 0.0,
                nic_ops_per_call: 0.0,
            }),
            server_stream: Some(fig(stream)),
            bidi: Some(fig(stream / 2.0)),
            skipped: Vec::new(),
            error: error.then(|| "failed".to_string()),
            secs: 1.0,
        }
    }

    #[test]
    fn medians_skip_failed_cells_and_ratios_use_the_best_tonic() {
        let cells = vec![
            cell(System::Rpc, 32, 4.0, 1e6, false),
            cell(System::Rpc, 32, 6.0, 3e6, false),
            cell(System::Rpc, 32, 1000.0, 1.0, true),
            cell(System::TonicCt, 32, 100.0, 1e5, false),
            cell(System::TonicMt, 32, 150.0, 2e5, false),
        ];
        let rows = summarize(&cells);
        let rpc = rows.iter().find(|r| r.system == System::Rpc).unwrap();
        assert_eq!(rpc.reps, 2);
        assert_eq!(rpc.p50_us, Some(5.0));
        assert_eq!(rpc.p50_range_us, Some((4.0, 6.0)));
        assert_eq!(rpc.server_stream.unwrap().msgs_per_s, 2e6);
        assert_eq!(rpc.bidi_in_flight, Some(8));
        let r = &ratios(&rows)[0];
        assert_eq!(r.p50, Some(20.0));
        assert_eq!(r.best_tonic["p50"], System::TonicCt);
        assert_eq!(r.server_stream, Some(10.0));
        assert_eq!(r.best_tonic["server_stream"], System::TonicMt);
        assert_eq!(r.bidi, Some(10.0));
        let alone = summarize(&cells[..2]);
        assert!(ratios(&alone).is_empty(), "no tonic, no ratio");
        let report = StreamReport {
            sizes: vec![32],
            pipeline: 8,
            messages_per_call: BTreeMap::new(),
            rows,
            ratios: vec![r.clone()],
            cells,
            errors: vec!["rdma-rpc 32 B: failed".into()],
        };
        let t = table(&report, &serde_json::json!(3), "soft");
        assert!(t.contains("bidi@8/s"), "{t}");
        assert!(t.contains("20.0x"), "{t}");
        assert!(t.contains("FAILED: rdma-rpc 32 B"), "{t}");
    }
}
