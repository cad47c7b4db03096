//! Operating-system plumbing of the soft RNIC: memfd segments and their mappings, pidfds (to
//! reach a peer's file descriptors and to learn that it died), eventfds (doorbells) and
//! cross-process copies (`process_vm_readv/writev`, as UCX's CMA transport does).
//!
//! Everything here is setup-path code except [`Mapping`]'s accessors, [`EventFd::signal`] and
//! [`cma_copy`], which the data path calls.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

/// The page size the soft RNIC's segments are mapped in and touched by.
pub(crate) const PAGE: usize = 4096;

/// A shared mapping of (a prefix of) a file, unmapped on drop.
///
/// Mappings of peers' segments are where remote writes land: the bytes may change at any time
/// under us (another process writes them), so they are only ever accessed through atomics
/// ([`Mapping::u32_at`], [`Mapping::u64_at`]) or raw-pointer copies of payload, never through
/// Rust references to plain data.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    writable: bool,
}

// SAFETY: a `Mapping` is a range of shared memory; every access goes through atomics or raw
// copies that tolerate concurrent writers, so sharing the handle between threads is sound.
unsafe impl Send for Mapping {}
// SAFETY: as for `Send`: no method hands out a reference to non-atomic data.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd` shared, read-write or read-only.
    pub(crate) fn map(fd: BorrowedFd<'_>, len: usize, writable: bool) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let prot = if writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        // SAFETY: mapping a new range chosen by the kernel (addr = NULL) cannot alias any
        // existing Rust object; the result is checked for MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                prot,
                libc::MAP_SHARED | libc::MAP_NORESERVE,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave NULL"))?;
        Ok(Mapping { ptr, len, writable })
    }

    /// First byte of the mapping.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Whether the mapping may be written.
    pub(crate) fn writable(&self) -> bool {
        self.writable
    }

    /// Maps the pages of `[off, off + len)` into this process's page tables now
    /// (`madvise(MADV_POPULATE_*)`), so that the first touch of each is not a page fault on the
    /// data path. A hint: ignored out of bounds and on kernels without it (before 5.14).
    pub(crate) fn populate(&self, off: usize, len: usize) {
        if len == 0 || !self.contains(off, len) {
            return;
        }
        let start = off - off % PAGE;
        let end = (off + len).next_multiple_of(PAGE).min(self.len);
        let advice = if self.writable {
            libc::MADV_POPULATE_WRITE
        } else {
            libc::MADV_POPULATE_READ
        };
        // SAFETY: `start..end` lies inside the mapping (page-aligned: the mapping is); the
        // advice only populates page tables, it changes no byte and no protection.
        unsafe {
            libc::madvise(self.ptr.as_ptr().add(start).cast(), end - start, advice);
        }
    }

    /// Whether `[off, off + len)` lies inside the mapping.
    pub(crate) fn contains(&self, off: usize, len: usize) -> bool {
        off.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// The 32-bit word at `off`, or `None` when `off` is out of bounds or unaligned.
    #[inline]
    pub(crate) fn u32_at(&self, off: usize) -> Option<&AtomicU32> {
        if !off.is_multiple_of(4) || !self.contains(off, 4) {
            return None;
        }
        // SAFETY: `off..off+4` is inside the mapping (checked above), which lives as long as
        // `self`; the address is 4-aligned (mappings are page-aligned and `off % 4 == 0`), and
        // `AtomicU32` has no invalid bit patterns, so any bytes a peer wrote are a valid value.
        // Concurrent writers only ever use atomics on these words.
        Some(unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU32>() })
    }

    /// The 64-bit word at `off`, or `None` when `off` is out of bounds or unaligned.
    #[inline]
    pub(crate) fn u64_at(&self, off: usize) -> Option<&AtomicU64> {
        if !off.is_multiple_of(8) || !self.contains(off, 8) {
            return None;
        }
        // SAFETY: as in `u32_at`, with 8-byte alignment and bounds checked.
        Some(unsafe { &*self.ptr.as_ptr().add(off).cast::<AtomicU64>() })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the range `map` created and nothing else unmaps
        // it; no reference derived from it outlives `self` (accessors borrow `self`).
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// Creates an anonymous memory file of `len` bytes (`memfd_create` + `ftruncate`).
pub(crate) fn memfd(name: &std::ffi::CStr, len: u64) -> io::Result<OwnedFd> {
    // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
    let fd =
        unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    crate::fdtable::opened(&fd);
    let len = libc::off_t::try_from(len).map_err(|_| io::Error::from_raw_os_error(libc::EFBIG))?;
    // SAFETY: plain syscall on a descriptor we own.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// Adds seals (`F_SEAL_*`) to a memfd.
pub(crate) fn add_seals(fd: BorrowedFd<'_>, seals: libc::c_int) -> io::Result<()> {
    // SAFETY: plain fcntl on a valid descriptor.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `fstat` of the file behind `fd`.
fn stat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: `stat` is plain data; zeroed is a valid value and fstat overwrites it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `st` is a valid out-pointer for the duration of the call.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Size of the file behind `fd`.
pub(crate) fn file_size(fd: BorrowedFd<'_>) -> io::Result<u64> {
    u64::try_from(stat(fd)?.st_size).map_err(|_| io::Error::other("negative file size"))
}

/// The seals of a memfd (`F_GET_SEALS`).
pub(crate) fn seals(fd: BorrowedFd<'_>) -> io::Result<libc::c_int> {
    // SAFETY: plain fcntl on a valid descriptor.
    let r = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(r)
}

/// `pidfd_open(pid)`: a descriptor that names process `pid` and becomes readable when it exits.
pub(crate) fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    if pid <= 0 {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    // SAFETY: raw syscall with integer arguments; the result is checked.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    let fd = RawFd::try_from(r).map_err(|_| io::Error::other("pidfd out of range"))?;
    // SAFETY: the kernel just returned this new descriptor; we own it.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    crate::fdtable::opened(&fd);
    Ok(fd)
}

/// A duplicate of this process's descriptor `fd` (close-on-exec).
pub(crate) fn dup_own(fd: u32) -> io::Result<OwnedFd> {
    let fd = libc::c_int::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: fcntl with an integer descriptor and command; the result is checked.
    let r = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this new descriptor; we own it.
    let fd = unsafe { OwnedFd::from_raw_fd(r) };
    crate::fdtable::opened(&fd);
    Ok(fd)
}

/// A duplicate of descriptor `fd` of the process behind `pidfd` (`pidfd_getfd`), falling back to
/// opening `/proc/PID/fd/N` when the syscall is unavailable.
pub(crate) fn pidfd_getfd(pidfd: BorrowedFd<'_>, pid: u32, fd: u32) -> io::Result<OwnedFd> {
    let target =
        libc::c_int::try_from(fd).map_err(|_| io::Error::from_raw_os_error(libc::EBADF))?;
    // SAFETY: raw syscall with integer arguments; the result is checked.
    let r = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) };
    if r >= 0 {
        let raw = RawFd::try_from(r).map_err(|_| io::Error::other("fd out of range"))?;
        // SAFETY: the kernel just returned this new descriptor; we own it.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        crate::fdtable::opened(&fd);
        return Ok(fd);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::ENOSYS) && err.raw_os_error() != Some(libc::EPERM) {
        return Err(err);
    }
    let path = format!("/proc/{pid}/fd/{fd}");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .or_else(|_| std::fs::File::open(&path))?;
    crate::fdtable::opened(&f);
    Ok(OwnedFd::from(f))
}

/// An eventfd used as a doorbell: `signal` adds one, `wait`/`drain` consume.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A new non-blocking eventfd.
    pub(crate) fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel just returned this new descriptor; we own it.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        crate::fdtable::opened(&fd);
        Ok(EventFd(fd))
    }

    /// Adds one to the counter (wakes a sleeper).
    pub(crate) fn signal(&self) {
        signal_fd(self.0.as_fd());
    }

    /// Consumes the counter without blocking; returns its value (0 when nothing was pending).
    pub(crate) fn drain(&self) -> io::Result<u64> {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into `v`, a valid, writable 8-byte location.
        let r = unsafe {
            libc::read(
                self.0.as_raw_fd(),
                (&raw mut v).cast(),
                std::mem::size_of::<u64>(),
            )
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::WouldBlock {
                return Ok(0);
            }
            return Err(e);
        }
        Ok(v)
    }

    /// Sleeps until the counter is non-zero or `timeout` passes (None: forever); does not
    /// consume. Returns whether it became readable.
    pub(crate) fn wait_readable(&self, timeout: Option<Duration>) -> io::Result<bool> {
        let mut p = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = match timeout {
            None => -1,
            Some(d) => {
                // Round up so that a 100 µs timeout does not become a busy 0 ms poll.
                let ms = d.as_nanos().div_ceil(1_000_000);
                libc::c_int::try_from(ms).unwrap_or(libc::c_int::MAX)
            }
        };
        loop {
            // SAFETY: `p` is one valid pollfd for the duration of the call.
            let r = unsafe { libc::poll(&mut p, 1, ms) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            return Ok(r > 0);
        }
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// Whether `fd` is an eventfd (a peer's completion channel, before we signal it).
///
/// Every eventfd is a file of the kernel's one shared anonymous inode, so one `fstat`
/// comparing (device, inode) with an eventfd of our own answers on the connect path, where
/// reading the `/proc/self/fd` link walks procfs (about a tenth of a server's connect work).
/// Other files of that inode (epoll, timerfd, signalfd) pass too; they refuse the 8-byte
/// writes a signal makes, and no file, pipe or socket passes. A kernel that gives eventfds
/// inodes of their own fails the comparison and is asked through the link, as before.
pub(crate) fn is_eventfd(fd: BorrowedFd<'_>) -> bool {
    static ANON: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    let anon = *ANON.get_or_init(|| EventFd::new().ok().and_then(|e| inode_of(e.0.as_fd())));
    if anon.is_some() && inode_of(fd) == anon {
        return true;
    }
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .is_ok_and(|link| link.to_string_lossy() == "anon_inode:[eventfd]")
}

/// The (device, inode) of the file behind `fd`.
fn inode_of(fd: BorrowedFd<'_>) -> Option<(u64, u64)> {
    stat(fd).ok().map(|st| (st.st_dev, st.st_ino))
}

/// Adds one to the eventfd `fd` (ours or a duplicate of a peer's). Errors are ignored: a full
/// counter (EAGAIN) already means "wake up".
pub(crate) fn signal_fd(fd: BorrowedFd<'_>) {
    let one = 1u64;
    // SAFETY: writes 8 bytes from `one`, a valid 8-byte location.
    unsafe {
        libc::write(
            fd.as_raw_fd(),
            (&raw const one).cast(),
            std::mem::size_of::<u64>(),
        );
    }
}

/// A random 64-bit value from the kernel (`getrandom`), never zero.
pub(crate) fn random_u64() -> u64 {
    let mut v = 0u64;
    // SAFETY: writes at most 8 bytes into `v`.
    let r = unsafe { libc::getrandom((&raw mut v).cast(), 8, 0) };
    if r != 8 {
        // Fall back to time and address entropy; uniqueness, not secrecy, is what matters.
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        v = t ^ ((&raw const v) as u64).rotate_left(32) ^ u64::from(std::process::id());
    }
    v | 1
}

/// Checks that `[addr, addr + len)` is mapped in this process (`msync` reports ENOMEM for
/// holes).
pub(crate) fn is_mapped(addr: usize, len: usize) -> bool {
    let page = page_size();
    let start = addr & !(page - 1);
    let Some(end) = addr.checked_add(len) else {
        return false;
    };
    // SAFETY: msync with MS_ASYNC only inspects the mappings of the range; it neither reads
    // nor writes memory we could be aliasing.
    unsafe { libc::msync(start as *mut libc::c_void, end - start, libc::MS_ASYNC) == 0 }
}

/// The page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p)
        .ok()
        .filter(|p| p.is_power_of_two())
        .unwrap_or(4096)
}

/// Direction of a cross-process copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CmaDir {
    /// Local buffers -> the other process.
    Write,
    /// The other process -> local buffers.
    Read,
}

/// Copies between local iovecs and one remote range of process `pid` with
/// `process_vm_writev/readv`, looping over partial transfers.
///
/// # Safety
/// Every local iovec must name memory of this process that is valid for the copy's direction
/// (readable for [`CmaDir::Write`], writable and not otherwise accessed for [`CmaDir::Read`]).
pub(crate) unsafe fn cma_copy(
    pid: u32,
    dir: CmaDir,
    local: &mut [libc::iovec],
    mut remote_addr: u64,
) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    let mut first = 0usize;
    while first < local.len() {
        let total: usize = local[first..].iter().map(|v| v.iov_len).sum();
        if total == 0 {
            return Ok(());
        }
        let remote = libc::iovec {
            iov_base: remote_addr as *mut libc::c_void,
            iov_len: total,
        };
        let cnt = libc::c_ulong::try_from(local.len() - first).unwrap_or(0);
        // SAFETY: the local iovecs are valid per this function's contract; the remote range
        // is checked by the kernel (EFAULT when not mapped there), never dereferenced here.
        let r = unsafe {
            match dir {
                CmaDir::Write => {
                    libc::process_vm_writev(pid, local[first..].as_ptr(), cnt, &remote, 1, 0)
                }
                CmaDir::Read => {
                    libc::process_vm_readv(pid, local[first..].as_ptr(), cnt, &remote, 1, 0)
                }
            }
        };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        let mut done = usize::try_from(r).unwrap_or(0);
        if done == 0 {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        remote_addr += done as u64;
        while first < local.len() && done >= local[first].iov_len {
            done -= local[first].iov_len;
            first += 1;
        }
        if done > 0 {
            let v = &mut local[first];
            // SAFETY: `done < v.iov_len`, so the advanced base stays inside the same iovec.
            v.iov_base = unsafe { v.iov_base.cast::<u8>().add(done) }.cast();
            v.iov_len -= done;
        }
    }
    Ok(())
}

/// Monotonic nanoseconds since the first call in this process (vDSO clock, no system call).
pub(crate) fn now_ns() -> u64 {
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let e = *EPOCH.get_or_init(std::time::Instant::now);
    u64::try_from(e.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memfd_map_and_seal() {
        let fd = memfd(c"soft-test", 8192).unwrap();
        add_seals(fd.as_fd(), libc::F_SEAL_SHRINK | libc::F_SEAL_GROW).unwrap();
        assert_eq!(file_size(fd.as_fd()).unwrap(), 8192);
        let m = Mapping::map(fd.as_fd(), 8192, true).unwrap();
        m.u64_at(8)
            .unwrap()
            .store(7, std::sync::atomic::Ordering::Relaxed);
        assert!(m.u64_at(8190).is_none());
        assert!(m.u32_at(3).is_none());
        // SAFETY: plain syscall on a descriptor we own.
        let r = unsafe { libc::ftruncate(fd.as_raw_fd(), 0) };
        assert_ne!(r, 0, "shrink is sealed");
    }

    #[test]
    fn getfd_from_self() {
        let fd = memfd(c"soft-test-self", 4096).unwrap();
        let pidfd = pidfd_open(std::process::id()).unwrap();
        let dup = pidfd_getfd(pidfd.as_fd(), std::process::id(), fd.as_raw_fd() as u32).unwrap();
        assert_eq!(file_size(dup.as_fd()).unwrap(), 4096);
    }

    #[test]
    fn eventfds_are_told_from_other_files() {
        let e = EventFd::new().unwrap();
        assert!(is_eventfd(e.0.as_fd()));
        let dup = e.0.try_clone().unwrap();
        assert!(is_eventfd(dup.as_fd()));
        let fd = memfd(c"soft-test-not-eventfd", 4096).unwrap();
        assert!(!is_eventfd(fd.as_fd()));
        let (r, w) = std::io::pipe().unwrap();
        assert!(!is_eventfd(r.as_fd()));
        assert!(!is_eventfd(w.as_fd()));
        let sock = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        assert!(!is_eventfd(sock.as_fd()));
    }

    #[test]
    fn eventfd_roundtrip() {
        let e = EventFd::new().unwrap();
        assert!(!e.wait_readable(Some(Duration::from_millis(1))).unwrap());
        e.signal();
        e.signal();
        assert!(e.wait_readable(Some(Duration::ZERO)).unwrap());
        assert_eq!(e.drain().unwrap(), 2);
        assert_eq!(e.drain().unwrap(), 0);
    }

    #[test]
    fn mapped_check() {
        let v = vec![0u8; 10_000];
        assert!(is_mapped(v.as_ptr() as usize, v.len()));
        assert!(!is_mapped(8, 16));
        assert!(!is_mapped(usize::MAX - 4, 16));
    }
}
