//! Protection domains and memory regions: `ibv_alloc_pd`, `ibv_reg_mr`, page-aligned `mmap`
//! for provider-owned regions, and the RLIMIT_MEMLOCK check done before pinning.

use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

use rdma_sys::{ibv_alloc_pd, ibv_dealloc_pd, ibv_dereg_mr, ibv_mr, ibv_pd, ibv_reg_mr};

use super::Ib;
use super::cq::IbCq;
use super::device::{CtxShared, IbContext, last_errno, ret_errno};
use super::qp::IbQp;
use super::srq::IbSrq;
use crate::verbs::error::{ErrorKind, Verb, VerbsError};
use crate::verbs::types::{Access, QpCaps, SrqCaps};
use crate::verbs::{Mr, Pd, Result};

/// The fix for a low RLIMIT_MEMLOCK, in every message that needs it.
pub const MEMLOCK_FIX: &str = "raise the locked-memory limit: `ulimit -l unlimited` in the \
     shell, LimitMEMLOCK=infinity in the systemd unit, `--ulimit memlock=-1` for docker (or \
     `memlock` in /etc/security/limits.conf)";

/// `CAP_IPC_LOCK`: pinning memory is not limited by RLIMIT_MEMLOCK for holders of it.
const CAP_IPC_LOCK: u32 = 14;

/// The locked-memory situation of this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Memlock {
    /// RLIMIT_MEMLOCK soft limit in bytes; `None` is unlimited.
    pub limit: Option<u64>,
    /// Bytes already pinned by this process (`VmPin` + `VmLck` of /proc/self/status), when
    /// readable.
    pub pinned: Option<u64>,
    /// Whether the process has CAP_IPC_LOCK (then the limit does not apply).
    pub cap_ipc_lock: bool,
}

impl Memlock {
    /// Reads the limit and what is pinned already.
    pub fn current() -> Memlock {
        let mut rl = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `rl` is a valid out-pointer for the duration of the call.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
        let limit = if rc != 0 || rl.rlim_cur == libc::RLIM_INFINITY {
            None
        } else {
            Some(rl.rlim_cur)
        };
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
        };
        let kib = |name: &str| {
            field(name)
                .and_then(|v| v.trim_end_matches("kB").trim().parse::<u64>().ok())
                .map(|k| k * 1024)
        };
        let pinned = match (kib("VmPin:"), kib("VmLck:")) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0) + b.unwrap_or(0)),
        };
        let cap_ipc_lock = field("CapEff:")
            .and_then(|v| u64::from_str_radix(v, 16).ok())
            .is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0);
        Memlock {
            limit,
            pinned,
            cap_ipc_lock,
        }
    }

    /// Whether pinning `len` more bytes stays within the limit.
    pub fn allows(&self, len: u64) -> bool {
        match self.limit {
            None => true,
            Some(_) if self.cap_ipc_lock => true,
            Some(l) => self.pinned.unwrap_or(0).saturating_add(len) <= l,
        }
    }

    /// Checks that `len` more bytes may be pinned, with the fix in the error.
    ///
    /// # Errors
    /// [`ErrorKind::OutOfMemory`] when the limit would be exceeded.
    pub fn check(&self, verb: Verb, len: u64) -> Result<()> {
        if self.allows(len) {
            return Ok(());
        }
        let limit = self.limit.unwrap_or(u64::MAX);
        Err(VerbsError::new(
            verb,
            ErrorKind::OutOfMemory,
            format!(
                "registering {len} bytes would pin {} bytes in total, over RLIMIT_MEMLOCK \
                 ({limit} bytes): {MEMLOCK_FIX}",
                self.pinned.unwrap_or(0).saturating_add(len)
            ),
        ))
    }
}

/// An owned `ibv_pd`; deallocated when the last region and QP of it are gone.
pub(super) struct PdShared {
    pub(super) pd: NonNull<ibv_pd>,
    pub(super) ctx: Arc<CtxShared>,
}

// SAFETY: a PD is an immutable handle once allocated; libibverbs verbs that take it are
// thread-safe. Only Drop deallocates it.
unsafe impl Send for PdShared {}
// SAFETY: as above.
unsafe impl Sync for PdShared {}

impl Drop for PdShared {
    fn drop(&mut self) {
        // SAFETY: every MR and QP of this PD holds an `Arc<PdShared>`, so none is alive now;
        // deallocated exactly once, before the context (which we hold) is closed.
        let rc = unsafe { ibv_dealloc_pd(self.pd.as_ptr()) };
        if rc != 0 {
            tracing::warn!(errno = ret_errno(rc), "ibv_dealloc_pd failed");
        }
    }
}

/// A protection domain (`ibv_pd`).
pub struct IbPd {
    pub(super) shared: Arc<PdShared>,
}

impl fmt::Debug for IbPd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbPd")
            .field("device", &self.shared.ctx.label())
            .finish()
    }
}

impl IbPd {
    pub(super) fn alloc(ctx: &IbContext) -> Result<IbPd> {
        // SAFETY: the context is open (held by `ctx.shared`).
        let pd = unsafe { ibv_alloc_pd(ctx.shared.raw.as_ptr()) };
        let pd = NonNull::new(pd).ok_or_else(|| {
            VerbsError::from_errno(
                Verb::AllocPd,
                last_errno(),
                format!(
                    "cannot allocate a protection domain on {} (out of device resources?)",
                    ctx.label()
                ),
            )
        })?;
        Ok(IbPd {
            shared: Arc::new(PdShared {
                pd,
                ctx: Arc::clone(&ctx.shared),
            }),
        })
    }

    fn validate(&self, verb: Verb, len: usize, access: Access) -> Result<()> {
        if len == 0 {
            return Err(VerbsError::new(
                verb,
                ErrorKind::InvalidArgument,
                "zero-length memory region",
            ));
        }
        if !access.is_valid() {
            return Err(VerbsError::new(
                verb,
                ErrorKind::InvalidArgument,
                format!("access {access:?}: REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE"),
            ));
        }
        let max = self.shared.ctx.caps.max_mr_size;
        if len as u64 > max {
            return Err(VerbsError::new(
                verb,
                ErrorKind::ExceedsCaps,
                format!(
                    "region of {len} bytes exceeds the device's max_mr_size {max} on {}",
                    self.shared.ctx.label()
                ),
            ));
        }
        Memlock::current().check(verb, len as u64)
    }

    /// `ibv_reg_mr` with the error explained; `owned` is the mapping to free with the region.
    fn register(
        &self,
        verb: Verb,
        addr: *mut u8,
        len: usize,
        access: Access,
        owned: Option<Mapping>,
    ) -> Result<IbMr> {
        // Relaxed ordering (PCIe) lets the RNIC's writes into the region land out of order,
        // which is faster on many hosts; the completion is still written after the data, and
        // nothing in rdma-rpc polls memory for a WRITE's arrival (every arrival is a
        // completion). It is an optional flag: devices and kernels without it ignore it.
        let optional = if relaxed_ordering() {
            rdma_sys::ibv_access_flags::IBV_ACCESS_RELAXED_ORDERING.0
        } else {
            0
        };
        // SAFETY: the PD is alive (we hold it); the caller guarantees `[addr, addr + len)` is
        // mapped (for `alloc_mr`, our own fresh mapping). The access bits are the
        // IBV_ACCESS_* values (checked in `Access`) plus an optional flag, valid together.
        let mr = unsafe {
            ibv_reg_mr(
                self.shared.pd.as_ptr(),
                addr.cast(),
                len,
                (access.bits() | optional) as i32,
            )
        };
        let Some(mr) = NonNull::new(mr) else {
            let e = last_errno();
            let why = match e {
                libc::ENOMEM | libc::EAGAIN => {
                    let m = Memlock::current();
                    format!(
                        "cannot pin {len} bytes (RLIMIT_MEMLOCK {}, pinned {}): {MEMLOCK_FIX}",
                        m.limit
                            .map_or_else(|| "unlimited".to_owned(), |l| format!("{l} bytes")),
                        m.pinned
                            .map_or_else(|| "?".to_owned(), |p| format!("{p} bytes"))
                    )
                }
                libc::EFAULT => format!("[{addr:p}, +{len}) is not mapped in this process"),
                libc::EINVAL => format!(
                    "{} rejected access {access:?} for {len} bytes (unsupported flags?)",
                    self.shared.ctx.label()
                ),
                _ => String::new(),
            };
            return Err(VerbsError::from_errno(verb, e, why));
        };
        // SAFETY: libibverbs returned a valid `ibv_mr`; its key fields are immutable until
        // `ibv_dereg_mr`.
        let (lkey, rkey) = unsafe { ((*mr.as_ptr()).lkey, (*mr.as_ptr()).rkey) };
        Ok(IbMr {
            mr,
            addr: addr as u64,
            len,
            lkey,
            rkey,
            access,
            owned,
            _pd: Arc::clone(&self.shared),
        })
    }
}

/// `RPC_IB_RELAXED_ORDERING=0` registers without `IBV_ACCESS_RELAXED_ORDERING` (on by
/// default where the device supports it, as NCCL does).
pub const ENV_RELAXED_ORDERING: &str = "RPC_IB_RELAXED_ORDERING";

fn relaxed_ordering() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !std::env::var(ENV_RELAXED_ORDERING).is_ok_and(|v| v.trim() == "0"))
}

/// Regions this large are advised to the kernel for transparent huge pages: fewer pages to
/// pin and fewer translation entries in the RNIC.
const HUGE_PAGE: usize = 2 << 20;

/// An anonymous private mapping, unmapped on drop.
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Result<Mapping> {
        // SAFETY: sysconf has no memory-safety preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let rounded = len
            .checked_add(page - 1)
            .map(|l| l / page * page)
            .ok_or_else(|| {
                VerbsError::new(
                    Verb::AllocMr,
                    ErrorKind::InvalidArgument,
                    "region length overflows",
                )
            })?;
        // SAFETY: an anonymous private mapping at an address of the kernel's choice touches no
        // existing memory; the result is checked against MAP_FAILED.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                rounded,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VerbsError::from_errno(
                Verb::AllocMr,
                last_errno(),
                format!("mmap of {rounded} bytes failed (out of address space or memory)"),
            ));
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| {
            VerbsError::new(Verb::AllocMr, ErrorKind::OutOfMemory, "mmap returned NULL")
        })?;
        if rounded >= HUGE_PAGE {
            // SAFETY: `[p, p + rounded)` is the mapping just made; MADV_HUGEPAGE only changes
            // how the kernel backs it (a hint: failure, e.g. THP disabled, changes nothing).
            unsafe { libc::madvise(p, rounded, libc::MADV_HUGEPAGE) };
        }
        Ok(Mapping { ptr, len: rounded })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping is ours, of exactly `len` bytes, and the region registered on it
        // was deregistered first (IbMr drops the registration before its `owned` field).
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A registered memory region (`ibv_mr`).
pub struct IbMr {
    mr: NonNull<ibv_mr>,
    addr: u64,
    len: usize,
    lkey: u32,
    rkey: u32,
    access: Access,
    /// Dropped after the registration (field order does not matter: Drop::drop deregisters
    /// before any field is dropped).
    owned: Option<Mapping>,
    _pd: Arc<PdShared>,
}

// SAFETY: the `ibv_mr` pointer is only used by Drop (`ibv_dereg_mr`); everything else is plain
// data copied out at registration. The memory itself is the caller's concern (see `reg_mr`).
unsafe impl Send for IbMr {}
// SAFETY: as above: `&IbMr` only reads immutable copies.
unsafe impl Sync for IbMr {}

impl fmt::Debug for IbMr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IbMr")
            .field("addr", &format_args!("{:#x}", self.addr))
            .field("len", &self.len)
            .field("lkey", &format_args!("{:#x}", self.lkey))
            .field("rkey", &format_args!("{:#x}", self.rkey))
            .field("access", &self.access)
            .field("owned", &self.owned.is_some())
            .finish()
    }
}

impl Drop for IbMr {
    fn drop(&mut self) {
        // SAFETY: the region was registered by us and is deregistered exactly once; the PD is
        // still alive (we hold an Arc to it). Work requests naming it are the caller's
        // contract (`post_send`/`post_recv` safety sections).
        let rc = unsafe { ibv_dereg_mr(self.mr.as_ptr()) };
        if rc != 0 {
            tracing::warn!(
                errno = ret_errno(rc),
                "ibv_dereg_mr failed (a memory window still bound to the region?)"
            );
        }
    }
}

impl Mr for IbMr {
    fn addr(&self) -> u64 {
        self.addr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn lkey(&self) -> u32 {
        self.lkey
    }
    fn rkey(&self) -> u32 {
        self.rkey
    }
    fn access(&self) -> Access {
        self.access
    }
}

impl Pd<Ib> for IbPd {
    fn alloc_mr(&self, len: usize, access: Access) -> Result<IbMr> {
        self.validate(Verb::AllocMr, len, access)?;
        let map = Mapping::new(len)?;
        let addr = map.ptr.as_ptr();
        // `map` moves into the region, which deregisters before unmapping.
        self.register(Verb::AllocMr, addr, len, access, Some(map))
    }

    unsafe fn reg_mr(&self, addr: *mut u8, len: usize, access: Access) -> Result<IbMr> {
        self.validate(Verb::RegMr, len, access)?;
        if addr.is_null() || (addr as u64).checked_add(len as u64).is_none() {
            return Err(VerbsError::new(
                Verb::RegMr,
                ErrorKind::InvalidArgument,
                format!("range [{addr:p}, +{len}) is null or overflows"),
            ));
        }
        self.register(Verb::RegMr, addr, len, access, None)
    }

    fn bind_window_to(
        &self,
        mr: &IbMr,
        offset: usize,
        len: usize,
        access: Access,
        _to: crate::verbs::WindowTarget,
    ) -> Result<IbMr> {
        crate::verbs::check_window(mr.len, mr.access, offset, len, access)?;
        // Remote write needs local write on the registration itself (libibverbs' rule).
        let writes = Access::REMOTE_WRITE | Access::REMOTE_ATOMIC;
        let access = if access.bits() & writes.bits() != 0 {
            access | Access::LOCAL_WRITE
        } else {
            access
        };
        // A registration of the range alone: a fresh rkey covering exactly the range with
        // exactly the rights asked, deregistered (revoked) when dropped. Type-2 memory windows
        // bound to the QP would also shut out other QPs of the protection domain; see
        // `Pd::bind_window`.
        let addr = (mr.addr + offset as u64) as *mut u8;
        self.register(Verb::BindMw, addr, len, access, None)
    }

    fn create_qp(&self, send_cq: &IbCq, recv_cq: &IbCq, caps: QpCaps) -> Result<IbQp> {
        IbQp::create(self, send_cq, recv_cq, caps, None)
    }

    fn create_srq(&self, caps: SrqCaps) -> Result<IbSrq> {
        IbSrq::create(self, caps)
    }

    /// The receive CQ reserves the SRQ's `max_wr` once, for all the SRQ's QPs on it; any CQ
    /// of the device may be the receive CQ.
    fn create_qp_on_srq(
        &self,
        send_cq: &IbCq,
        recv_cq: &IbCq,
        caps: QpCaps,
        srq: &IbSrq,
    ) -> Result<IbQp> {
        IbQp::create(self, send_cq, recv_cq, caps, Some(srq))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memlock_rules() {
        let m = Memlock {
            limit: Some(64 << 10),
            pinned: Some(60 << 10),
            cap_ipc_lock: false,
        };
        assert!(m.allows(4 << 10));
        assert!(!m.allows(8 << 10));
        let e = m.check(Verb::RegMr, 8 << 10).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::OutOfMemory);
        assert!(e.to_string().contains("ulimit -l unlimited"), "{e}");
        assert!(e.to_string().contains("LimitMEMLOCK=infinity"), "{e}");
        assert!(e.to_string().contains("--ulimit memlock=-1"), "{e}");
        let cap = Memlock {
            cap_ipc_lock: true,
            ..m
        };
        assert!(cap.allows(1 << 40));
        let unl = Memlock { limit: None, ..m };
        assert!(unl.allows(1 << 40));
    }

    #[test]
    fn memlock_reads_this_process() {
        let m = Memlock::current();
        // Whatever the limit, pinning nothing more is allowed.
        assert!(m.allows(0));
    }
}
