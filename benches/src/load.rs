//! `rpc-bench run --background-load N`: N busy threads in a process of their own, spinning
//! from before the first measured phase to after the last, so that every phase of every system
//! (rdma-rpc, tonic, raw) runs beside them. They are not pinned: like other work on a shared
//! host they compete with the benchmark's processes for every core. A separate process, so
//! the client's CPU figures do not count them.

use std::hint::black_box;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};

use crate::sys;

/// Arguments of `rpc-bench load` (started by `run --background-load`).
#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Busy threads.
    #[arg(long)]
    pub threads: usize,
    /// Exit after this many seconds.
    #[arg(long)]
    pub max_secs: u64,
}

/// `rpc-bench load`: spins `threads` unpinned threads until `max_secs` pass or the parent
/// process dies.
///
/// # Errors
/// When a thread cannot be started.
pub fn run(args: &LoadArgs) -> Result<()> {
    sys::die_with_parent();
    let all: Vec<usize> = (0..sys::online_cpus()).collect();
    sys::pin_current_thread(&all);
    let deadline = Instant::now() + Duration::from_secs(args.max_secs);
    let mut threads = Vec::with_capacity(args.threads);
    for i in 0..args.threads {
        let t = std::thread::Builder::new()
            .name(format!("load-{i}"))
            .spawn(move || spin_until(deadline))
            .context("start a load thread")?;
        threads.push(t);
    }
    for t in threads {
        let _ = t.join();
    }
    Ok(())
}

/// Integer work (no memory traffic to speak of) until `deadline`.
fn spin_until(deadline: Instant) {
    let mut x = 1u64;
    while Instant::now() < deadline {
        for _ in 0..10_000 {
            x = black_box(
                x.wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407),
            );
        }
    }
    black_box(x);
}

/// The background load of a run: the `rpc-bench load` process, stopped when dropped.
#[derive(Debug)]
pub struct BackgroundLoad {
    child: Option<Child>,
}

impl BackgroundLoad {
    /// Starts `threads` busy threads (none for 0) that stop by themselves after `max_secs`.
    ///
    /// # Errors
    /// When the process cannot be started.
    pub fn start(threads: usize, max_secs: u64) -> Result<BackgroundLoad> {
        if threads == 0 {
            return Ok(BackgroundLoad { child: None });
        }
        let exe = std::env::current_exe().context("locate the rpc-bench executable")?;
        let child = Command::new(exe)
            .args([
                "load",
                "--threads",
                &threads.to_string(),
                "--max-secs",
                &max_secs.to_string(),
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("start the background load")?;
        Ok(BackgroundLoad { child: Some(child) })
    }

    /// Whether the load process is still running (it should be for the whole run).
    pub fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for BackgroundLoad {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
