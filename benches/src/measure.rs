//! What every measurement shares: latency histograms, time-boxed loops, the memcpy baseline and
//! a description of the machine.

use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::sys::{self, CpuTime};

/// How long each phase of a measurement runs.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Plan {
    /// Warm-up before every timed phase (not recorded).
    #[serde(with = "secs")]
    pub warmup: Duration,
    /// The timed one-outstanding (latency) phase.
    #[serde(with = "secs")]
    pub latency: Duration,
    /// Each timed many-outstanding (throughput) phase.
    #[serde(with = "secs")]
    pub rate: Duration,
    /// At least this many calls are timed in each phase, however long they take (bounded by
    /// `max_phase`).
    pub min_calls: u64,
    /// A phase stops after this long even below `min_calls`.
    #[serde(with = "secs")]
    pub max_phase: Duration,
}

mod secs {
    pub fn serialize<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_f64(d.as_secs_f64())
    }
}

impl Plan {
    /// Whether a phase that started at `start` and has done `calls` calls is over.
    pub fn done(&self, start: Instant, target: Duration, calls: u64) -> bool {
        let el = start.elapsed();
        (el >= target && calls >= self.min_calls) || el >= self.max_phase
    }

    /// Whether a warm-up that started at `start` with `calls` calls is over (at least 2 calls).
    pub fn warm(&self, start: Instant, calls: u64) -> bool {
        let el = start.elapsed();
        (el >= self.warmup && calls >= 2) || el >= self.max_phase
    }
}

/// A latency histogram in nanoseconds, 1 ns to 10 minutes, 3 significant digits.
pub fn histogram() -> Histogram<u64> {
    // Bounds are constants within hdrhistogram's limits (low >= 1, high >= 2 * low, sigfig
    // <= 5), so construction cannot fail; fall back to an auto-resizing histogram anyway.
    Histogram::new_with_bounds(1, 600_000_000_000, 3)
        .or_else(|_| Histogram::new(3))
        .unwrap_or_else(|_| unreachable!("3 significant digits is valid"))
}

/// Records `d` (clamped into the histogram's range).
pub fn record(h: &mut Histogram<u64>, d: Duration) {
    let ns = (d.as_nanos() as u64).clamp(1, 600_000_000_000);
    h.saturating_record(ns);
}

/// CPU time of both sides over one timed phase, and what their soft RNICs did.
#[derive(Clone, Copy, Debug, Default)]
pub struct CpuDelta {
    /// The client process (this one).
    pub client: CpuTime,
    /// The server process.
    pub server: CpuTime,
    /// Payload bytes the soft RNICs of both processes copied.
    pub nic_bytes: u64,
    /// Work requests the soft RNICs of both processes executed.
    pub nic_ops: u64,
}

/// One timed one-outstanding phase.
#[derive(Debug)]
pub struct LatencyRun {
    /// Round-trip times.
    pub hist: Histogram<u64>,
    /// Calls timed.
    pub calls: u64,
    /// Wall time of the timed phase.
    pub wall: Duration,
    /// CPU time over the timed phase.
    pub cpu: CpuDelta,
}

/// One timed many-outstanding phase.
#[derive(Debug)]
pub struct RateRun {
    /// Calls completed.
    pub calls: u64,
    /// Wall time of the timed phase.
    pub wall: Duration,
    /// CPU time over the timed phase.
    pub cpu: CpuDelta,
}

/// Single-thread memcpy bandwidth for `size`-byte copies between two warm buffers, in GB/s
/// (10^9 bytes per second), over about `time`.
pub fn memcpy_gbps(size: usize, time: Duration) -> f64 {
    let src = vec![0x5au8; size];
    let mut dst = vec![0u8; size];
    // Fault both buffers in and warm the caches.
    dst.copy_from_slice(&src);
    let start = Instant::now();
    let mut copies = 0u64;
    while copies < 2 || start.elapsed() < time {
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&mut dst);
        copies += 1;
    }
    let secs = start.elapsed().as_secs_f64();
    (copies as f64 * size as f64) / secs / 1e9
}

/// The 1, 5 and 15 minute load averages.
pub fn load_avg() -> Option<[f64; 3]> {
    let s = std::fs::read_to_string("/proc/loadavg").ok()?;
    let mut it = s.split_whitespace().map(|x| x.parse::<f64>().ok());
    Some([it.next()??, it.next()??, it.next()??])
}

/// The machine a measurement ran on.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// Host name.
    pub host: String,
    /// CPU model name.
    pub cpu: String,
    /// Online CPUs.
    pub cpus: usize,
    /// Memory in GiB.
    pub mem_gib: f64,
    /// Kernel release.
    pub kernel: String,
}

impl Machine {
    /// Describes this machine (fields it cannot read are "unknown").
    pub fn this() -> Machine {
        let read = |p: &str| std::fs::read_to_string(p).unwrap_or_default();
        let cpu = read("/proc/cpuinfo")
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split_once(':'))
            .map_or("unknown".to_string(), |(_, v)| v.trim().to_string());
        let mem_gib = read("/proc/meminfo")
            .lines()
            .find(|l| l.starts_with("MemTotal:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<f64>().ok())
            .map_or(0.0, |kb| (kb / (1024.0 * 1024.0) * 10.0).round() / 10.0);
        let kernel = read("/proc/sys/kernel/osrelease").trim().to_string();
        let host = read("/proc/sys/kernel/hostname").trim().to_string();
        Machine {
            host: if host.is_empty() {
                "unknown".into()
            } else {
                host
            },
            cpu,
            cpus: sys::online_cpus(),
            mem_gib,
            kernel: if kernel.is_empty() {
                "unknown".into()
            } else {
                kernel
            },
        }
    }

    /// One line.
    pub fn describe(&self) -> String {
        format!(
            "{} ({} CPUs, {} GiB, Linux {}) on {}",
            self.cpu, self.cpus, self.mem_gib, self.kernel, self.host
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_records_and_clamps() {
        let mut h = histogram();
        record(&mut h, Duration::from_nanos(0));
        record(&mut h, Duration::from_micros(3));
        record(&mut h, Duration::from_secs(3600));
        assert_eq!(h.len(), 3);
        assert_eq!(h.min(), 1);
        assert!(h.max() >= 599_000_000_000);
    }

    #[test]
    fn memcpy_measures_something_plausible() {
        let g = memcpy_gbps(1 << 16, Duration::from_millis(5));
        assert!(g > 0.01 && g < 10_000.0, "{g} GB/s");
    }

    #[test]
    fn plan_bounds_phases() {
        let p = Plan {
            warmup: Duration::ZERO,
            latency: Duration::ZERO,
            rate: Duration::ZERO,
            min_calls: 10,
            max_phase: Duration::from_secs(60),
        };
        let t = Instant::now();
        assert!(!p.done(t, Duration::ZERO, 9));
        assert!(p.done(t, Duration::ZERO, 10));
        assert!(!p.warm(t, 1));
        assert!(p.warm(t, 2));
    }
}
