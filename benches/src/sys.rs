//! The few operating-system calls the harness needs: CPU affinity, the parent-death signal and
//! CPU time (`getrusage`).

use std::time::Duration;

/// CPU time consumed, user and system.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CpuTime {
    /// User time.
    pub user: Duration,
    /// System time.
    pub sys: Duration,
}

impl CpuTime {
    /// User plus system time.
    pub fn total(&self) -> Duration {
        self.user + self.sys
    }

    /// `self - earlier`, saturating at zero.
    pub fn since(&self, earlier: CpuTime) -> CpuTime {
        CpuTime {
            user: self.user.saturating_sub(earlier.user),
            sys: self.sys.saturating_sub(earlier.sys),
        }
    }

    /// The two times in nanoseconds, as the control protocol sends them.
    pub fn to_nanos(self) -> (u64, u64) {
        (self.user.as_nanos() as u64, self.sys.as_nanos() as u64)
    }

    /// From nanoseconds.
    pub fn from_nanos(user: u64, sys: u64) -> CpuTime {
        CpuTime {
            user: Duration::from_nanos(user),
            sys: Duration::from_nanos(sys),
        }
    }
}

/// What the soft RNICs of this process did so far: (payload bytes copied, work requests
/// executed). Zero for other providers, which do not count.
pub fn nic_counters() -> (u64, u64) {
    let c = rpc_core::verbs::soft::process_counters();
    (c.bytes_copied, c.ops)
}

/// CPU time of the whole calling process (every thread), from `getrusage(RUSAGE_SELF)`.
pub fn process_cpu() -> CpuTime {
    // SAFETY: `rusage` is plain data for which all-zero is valid; getrusage writes only into
    // the struct we pass, which lives on this stack frame for the whole call.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut ru) != 0 {
            return CpuTime::default();
        }
        ru
    };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec.max(0) as u64) + Duration::from_micros(t.tv_usec.max(0) as u64)
    };
    CpuTime {
        user: tv(ru.ru_utime),
        sys: tv(ru.ru_stime),
    }
}

/// Restricts the calling thread (and the threads it spawns afterwards) to `cores`. Returns
/// whether the kernel accepted the set; an empty or out-of-range set is refused (false).
pub fn pin_current_thread(cores: &[usize]) -> bool {
    let limit = libc::CPU_SETSIZE as usize;
    if cores.is_empty() || cores.iter().any(|&c| c >= limit) {
        return false;
    }
    // SAFETY: `cpu_set_t` is plain data and all-zero is the empty set; CPU_SET writes inside
    // it only for indexes below CPU_SETSIZE (checked above); sched_setaffinity(0, ..) reads the
    // set we own and changes the calling thread only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        for &c in cores {
            libc::CPU_SET(c, &mut set);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// The cores the calling thread may run on.
pub fn current_affinity() -> Vec<usize> {
    // SAFETY: as in `pin_current_thread`; sched_getaffinity writes into the set we own, and
    // CPU_ISSET reads indexes below CPU_SETSIZE only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Asks the kernel to kill this process when its parent dies, so no benchmark server outlives
/// the harness. Returns false when the parent is already gone.
pub fn die_with_parent() -> bool {
    // SAFETY: PR_SET_PDEATHSIG takes a signal number and touches no memory of ours; getppid
    // has no preconditions.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
        libc::getppid() != 1
    }
}

/// Number of online CPUs.
pub fn online_cpus() -> usize {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
    usize::try_from(n).unwrap_or(1).max(1)
}
