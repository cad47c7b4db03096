//! Keeps the process's descriptor table ahead of the descriptors the runtime opens.
//!
//! Linux grows a process's descriptor table by doubling it (256, 512, 1024, ...) inside the
//! call that needs the next slot, and when several threads share the table, that call waits an
//! RCU grace period before it frees the old one: 12-15 ms on this project's VMs (`strace -T`
//! on the `memfd_create`, `eventfd2` or `socket` that returned descriptor 256, 512, 1024 or
//! 2048). A connect or an accept that crossed the boundary took that long, and on a server the
//! shard thread that mapped a client's memory stalled every connection it served.
//!
//! Every descriptor the runtime opens is reported here ([`opened`]). Once one reaches half the
//! table this module knows of, a short-lived helper thread grows the table to twice that size
//! by duplicating a descriptor to the top slot and closing it again; the helper takes the
//! grace period, and the threads that open descriptors find the table already large enough.
//! The table never grows past the soft `RLIMIT_NOFILE`, and the kernel never shrinks it: the
//! cost is the table the process would have reached anyway, reached a little earlier (8 bytes
//! per slot).

use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU32, Ordering};

/// The smallest table this module asks for (the kernel starts a process at 64 slots).
const FIRST: u32 = 1024;

/// The table size this process asked for so far (0: none yet).
static ASKED: AtomicU32 = AtomicU32::new(0);

/// Reports a descriptor the runtime just opened; grows the table in the background when the
/// descriptor reached half of it. One load and one compare when there is room.
pub(crate) fn opened(fd: impl AsFd) {
    let n = u32::try_from(fd.as_fd().as_raw_fd()).unwrap_or(0);
    let asked = ASKED.load(Ordering::Relaxed);
    if n.saturating_mul(2) >= asked {
        grow(n, asked);
    }
}

#[cold]
fn grow(n: u32, asked: u32) {
    let target = n
        .saturating_mul(4)
        .checked_next_power_of_two()
        .unwrap_or(u32::MAX)
        .max(FIRST)
        .min(soft_limit());
    if target <= asked
        || ASKED
            .compare_exchange(asked, target, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
    {
        return; // At the limit already, or another thread is growing it.
    }
    let spawned = std::thread::Builder::new()
        .name("rpc-fdtable".into())
        .spawn(move || reserve(target));
    if let Err(e) = spawned {
        tracing::debug!("descriptor table: no helper thread ({e}); the kernel grows it on demand");
    }
}

/// Makes the table hold `slots` descriptors: a duplicate at slot `slots - 1`, closed at once.
fn reserve(slots: u32) {
    let Ok(top) = i32::try_from(slots.saturating_sub(1)) else {
        return;
    };
    let grown = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
        .and_then(|e| rustix::io::fcntl_dupfd_cloexec(&e, top));
    if let Err(e) = grown {
        tracing::debug!("descriptor table: could not grow it to {slots} slots ({e})");
    }
}

/// The soft `RLIMIT_NOFILE`, which bounds every descriptor number: no table is asked beyond it.
fn soft_limit() -> u32 {
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    lim.current
        .map_or(u32::MAX, |c| u32::try_from(c).unwrap_or(u32::MAX))
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table_slots() -> u32 {
        // The table's size, as /proc/self/status reports it.
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("FDSize:")).unwrap();
        line["FDSize:".len()..].trim().parse().unwrap()
    }

    /// Raises the soft descriptor limit towards `want` (the hard limit allowing).
    fn raise_soft_limit(want: u64) {
        use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
        let lim = getrlimit(Resource::Nofile);
        let soft = lim.current.unwrap_or(u64::MAX);
        let target = want.min(lim.maximum.unwrap_or(u64::MAX));
        if soft < target {
            let _ = setrlimit(
                Resource::Nofile,
                Rlimit {
                    current: Some(target),
                    maximum: lim.maximum,
                },
            );
        }
    }

    #[test]
    fn a_descriptor_past_half_the_table_grows_it_in_the_background() {
        raise_soft_limit(8 * u64::from(FIRST));
        let limit = soft_limit();
        if limit < 4 * FIRST {
            eprintln!("skipped: RLIMIT_NOFILE {limit} leaves no room to grow past {FIRST}");
            return;
        }
        let e = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).unwrap();
        opened(&e); // Asks for FIRST slots at least.
        // A descriptor at 1.5x FIRST: past half of what was asked.
        let high = rustix::io::fcntl_dupfd_cloexec(&e, (FIRST + FIRST / 2) as i32).unwrap();
        opened(&high);
        let asked = ASKED.load(Ordering::Relaxed);
        assert!(asked >= 4 * FIRST, "asked {asked}");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while table_slots() < asked {
            assert!(
                std::time::Instant::now() < deadline,
                "table stayed at {}",
                table_slots()
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // Below half of it nothing more is asked.
        opened(&e);
        assert_eq!(ASKED.load(Ordering::Relaxed), asked);
    }
}
