//! What the runner asks of every system's client, and the loops the async clients share.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};

use crate::measure::{CpuDelta, LatencyRun, Plan, RateRun};
use crate::sys::CpuTime;

/// Most calls outstanding at once that the clients are set up for.
pub const MAX_OUTSTANDING: usize = 128;

/// How long one call may take before it counts as failed, unless the command line says
/// otherwise.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// CPU time and soft RNIC counters of both processes at one instant.
#[derive(Clone, Copy, Debug, Default)]
pub struct Snapshot {
    /// This (client) process.
    pub client: CpuTime,
    /// The server process.
    pub server: CpuTime,
    /// (bytes copied, work requests) of this process's soft RNICs.
    pub client_nic: (u64, u64),
    /// The same for the server process.
    pub server_nic: (u64, u64),
}

impl Snapshot {
    /// What both processes used since `earlier`.
    pub fn since(&self, earlier: Snapshot) -> CpuDelta {
        let d = |a: (u64, u64), b: (u64, u64)| (a.0.saturating_sub(b.0), a.1.saturating_sub(b.1));
        let (cb, co) = d(self.client_nic, earlier.client_nic);
        let (sb, so) = d(self.server_nic, earlier.server_nic);
        CpuDelta {
            client: self.client.since(earlier.client),
            server: self.server.since(earlier.server),
            nic_bytes: cb + sb,
            nic_ops: co + so,
        }
    }
}

/// Reads both processes' CPU time.
pub trait Probe {
    /// CPU time of this process and of the server process now.
    ///
    /// # Errors
    /// When the server host does not answer.
    fn snapshot(&mut self) -> Result<Snapshot>;
}

/// One connected client of one system.
pub trait BenchClient {
    /// Warms up, then times calls of `size` bytes each way, one at a time.
    ///
    /// # Errors
    /// When a call fails.
    fn latency(&mut self, size: usize, plan: &Plan, probe: &mut dyn Probe) -> Result<LatencyRun>;

    /// Warms up, then counts calls of `size` bytes each way with `outstanding` in flight.
    ///
    /// # Errors
    /// When a call fails.
    fn rate(
        &mut self,
        size: usize,
        outstanding: usize,
        plan: &Plan,
        probe: &mut dyn Probe,
    ) -> Result<RateRun>;

    /// The streaming measurements of this system; `None` for a system without streaming
    /// calls (the raw ping-pong).
    fn streams(&mut self) -> Option<&mut dyn crate::stream::StreamClient> {
        None
    }
}

/// When a phase ends, given its start and the calls completed so far.
pub type StopRule = Arc<dyn Fn(Instant, u64) -> bool + Send + Sync>;

/// Keeps `k` calls in flight on the current runtime, each task calling `call` in a loop,
/// until `stop` says so; calls that complete after that are not counted. Returns the calls
/// counted and the time the stop came.
///
/// # Errors
/// The first failed call's error.
pub async fn windowed_async<F, Fut>(k: usize, stop: StopRule, call: F) -> Result<(u64, Duration)>
where
    F: Fn() -> Fut + Clone + Send + 'static,
    Fut: Future<Output = Result<()>> + Send + 'static,
{
    let start = Instant::now();
    let stopped = Arc::new(AtomicBool::new(false));
    let stopped_at = Arc::new(AtomicU64::new(0));
    let count = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::with_capacity(k);
    for _ in 0..k {
        let (call, stop, stopped, stopped_at, count) = (
            call.clone(),
            Arc::clone(&stop),
            Arc::clone(&stopped),
            Arc::clone(&stopped_at),
            Arc::clone(&count),
        );
        tasks.push(tokio::spawn(async move {
            while !stopped.load(Ordering::Acquire) {
                let r = call().await;
                if stopped.load(Ordering::Acquire) {
                    break;
                }
                if let Err(e) = r {
                    stopped.store(true, Ordering::Release);
                    return Err(e);
                }
                let n = count.fetch_add(1, Ordering::AcqRel) + 1;
                // The rule reads the clock: every 8th call is often enough (the phase ends at
                // most a few calls late) and keeps the harness's own cost per call low.
                if n % 8 == 0 && stop(start, n) && !stopped.swap(true, Ordering::AcqRel) {
                    stopped_at.store(start.elapsed().as_nanos() as u64, Ordering::Release);
                }
            }
            Ok(())
        }));
    }
    let mut first_err = None;
    for t in tasks {
        let r = t.await.map_err(|e| anyhow!("benchmark task failed: {e}"));
        if let Err(e) = r.and_then(|r| r)
            && first_err.is_none()
        {
            first_err = Some(e);
        }
    }
    if let Some(e) = first_err {
        return Err(e);
    }
    let at = match stopped_at.load(Ordering::Acquire) {
        0 => start.elapsed(),
        ns => Duration::from_nanos(ns),
    };
    Ok((count.load(Ordering::Acquire), at))
}

/// The payload of a call of `size` bytes: a recognisable pattern, shared by every call.
pub fn payload(size: usize) -> bytes::Bytes {
    bytes::Bytes::from((0..size).map(|i| (i % 251) as u8).collect::<Vec<u8>>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windowed_counts_until_the_rule_stops_it() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let (n, _) = rt
            .block_on(windowed_async(4, Arc::new(|_, n| n >= 97), || async {
                tokio::task::yield_now().await;
                Ok(())
            }))
            .unwrap();
        // The rule is asked every 8th call (104 is the first such count >= 97); tasks already
        // past the check may finish one more call each, uncounted.
        assert_eq!(n, 104);
    }

    #[test]
    fn windowed_reports_the_first_error() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let e = rt
            .block_on(windowed_async(2, Arc::new(|_, _| false), || async {
                Err::<(), _>(anyhow!("boom"))
            }))
            .unwrap_err();
        assert!(e.to_string().contains("boom"));
    }
}
