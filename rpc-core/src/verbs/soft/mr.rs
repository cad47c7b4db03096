//! Memory regions: the MR table in the published segment, shm-backed regions
//! ([`Pd::alloc_mr`](crate::verbs::Pd::alloc_mr)) and user-memory regions
//! ([`Pd::reg_mr`](crate::verbs::Pd::reg_mr)), and the local key checks.
//!
//! Registration writes the entry's fields, then its key (Release); deregistration clears the
//! key first. A peer reads key, fields, key again (a seqlock), so it never acts on a torn or
//! freed entry. For user-memory regions, which a peer reaches with `process_vm_*` or directly
//! (same process), the peer also raises the region's pin counter (in our inbox) around the
//! access, and deregistration waits (bounded) for it to drop to zero before returning the
//! memory to its owner: a deregistered range is never written afterwards.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::layout::{self, mr};
use super::shm::{self, Mapping};
use super::{CAPS, Device};
use crate::verbs::{Access, ErrorKind, Mr, Result, Verb, VerbsError};

/// How long deregistration waits for peers' in-flight accesses to a user-memory region.
const DEREG_WAIT: Duration = Duration::from_secs(2);

/// A registered memory region of the soft RNIC. Dropping it deregisters it.
#[derive(Debug)]
pub struct SoftMr {
    dev: Arc<Device>,
    slot: u32,
    key: u32,
    addr: u64,
    len: usize,
    access: Access,
    pd: u32,
    backing: Backing,
}

#[derive(Debug)]
enum Backing {
    /// Memory owned by the region: a sealed memfd, mapped here.
    Shm { _fd: OwnedFd, _map: Mapping },
    /// Caller's memory.
    User,
    /// A window on another region (which the window's user keeps registered).
    Window,
}

fn check_args(verb: Verb, len: usize, access: Access) -> Result<()> {
    if len == 0 {
        return Err(VerbsError::new(
            verb,
            ErrorKind::InvalidArgument,
            "zero-length memory registration: regions must hold at least one byte",
        ));
    }
    if !access.is_valid() {
        return Err(VerbsError::new(
            verb,
            ErrorKind::InvalidArgument,
            format!(
                "invalid access flags {access:?}: REMOTE_WRITE and REMOTE_ATOMIC need LOCAL_WRITE"
            ),
        ));
    }
    if len as u64 > CAPS.max_mr_size {
        return Err(VerbsError::new(
            verb,
            ErrorKind::ExceedsCaps,
            format!(
                "region of {len} bytes exceeds the soft RNIC's max_mr_size ({} bytes)",
                CAPS.max_mr_size
            ),
        ));
    }
    Ok(())
}

impl SoftMr {
    /// `alloc_mr`: a zeroed region in its own memfd.
    pub(crate) fn alloc(dev: &Arc<Device>, pd: u32, len: usize, access: Access) -> Result<SoftMr> {
        let verb = Verb::AllocMr;
        check_args(verb, len, access)?;
        let page = shm::page_size();
        let size = len.checked_add(page - 1).ok_or_else(|| {
            VerbsError::new(verb, ErrorKind::InvalidArgument, "region length overflows")
        })? & !(page - 1);
        let fd = shm::memfd(c"soft-rnic-mr", size as u64).map_err(|e| {
            VerbsError::from_errno(
                verb,
                e.raw_os_error().unwrap_or(libc::ENOMEM),
                format!("cannot create a {size}-byte memfd for the region"),
            )
        })?;
        shm::add_seals(
            fd.as_fd(),
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL,
        )
        .map_err(|e| {
            VerbsError::from_errno(
                verb,
                e.raw_os_error().unwrap_or(libc::EINVAL),
                "cannot seal the region's memfd",
            )
        })?;
        let map = Mapping::map(fd.as_fd(), size, true).map_err(|e| {
            VerbsError::from_errno(
                verb,
                e.raw_os_error().unwrap_or(libc::ENOMEM),
                format!("cannot map a {size}-byte region"),
            )
        })?;
        let addr = map.ptr() as u64;
        let fd_num = fd.as_raw_fd() as u32;
        Self::publish(
            dev,
            verb,
            pd,
            addr,
            len,
            access,
            (layout::MR_KIND_SHM, fd_num),
            (0, 0),
            Backing::Shm { _fd: fd, _map: map },
        )
    }

    /// `reg_mr` on caller memory.
    ///
    /// # Safety
    /// As [`Pd::reg_mr`](crate::verbs::Pd::reg_mr).
    pub(crate) unsafe fn register(
        dev: &Arc<Device>,
        pd: u32,
        addr: *mut u8,
        len: usize,
        access: Access,
    ) -> Result<SoftMr> {
        let verb = Verb::RegMr;
        check_args(verb, len, access)?;
        let a = addr as usize;
        if a.checked_add(len).is_none() {
            return Err(VerbsError::new(
                verb,
                ErrorKind::InvalidArgument,
                format!("region [{a:#x}, +{len}) overflows the address space"),
            ));
        }
        if addr.is_null() || !shm::is_mapped(a, len) {
            return Err(VerbsError::from_errno(
                verb,
                libc::EFAULT,
                format!("region [{a:#x}, +{len}) is not mapped in this process"),
            ));
        }
        Self::publish(
            dev,
            verb,
            pd,
            a as u64,
            len,
            access,
            (layout::MR_KIND_USER, u32::MAX),
            (0, 0),
            Backing::User,
        )
    }

    /// `bind_window`: `[offset, offset + len)` of `parent` for the peer RNIC `peer` only.
    pub(crate) fn window(
        dev: &Arc<Device>,
        pd: u32,
        parent: &SoftMr,
        offset: usize,
        len: usize,
        access: Access,
        peer: u64,
    ) -> Result<SoftMr> {
        let verb = Verb::BindMw;
        let bad = |detail: String| Err(VerbsError::new(verb, ErrorKind::InvalidArgument, detail));
        if !Arc::ptr_eq(dev, &parent.dev) || parent.pd != pd {
            return bad("the region belongs to another protection domain".into());
        }
        crate::verbs::check_window(parent.len, parent.access, offset, len, access)?;
        if !matches!(parent.backing, Backing::Shm { .. }) {
            return bad("windows lend memory from alloc_mr (shared memory) only".into());
        }
        if peer == 0 {
            return bad("the QP is not connected to a peer (windows are bound to one)".into());
        }
        Self::publish(
            dev,
            verb,
            pd,
            parent.addr + offset as u64,
            len,
            access,
            (layout::MR_KIND_WINDOW, parent.slot),
            (parent.key, peer),
            Backing::Window,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn publish(
        dev: &Arc<Device>,
        verb: Verb,
        pd: u32,
        addr: u64,
        len: usize,
        access: Access,
        (kind, fd): (u32, u32),
        (parent_key, bound): (u32, u64),
        backing: Backing,
    ) -> Result<SoftMr> {
        let (slot, gen_) = dev.mr_slots.alloc().ok_or_else(|| {
            VerbsError::new(
                verb,
                ErrorKind::ExceedsCaps,
                format!(
                    "the soft RNIC's MR table is full ({} regions): deregister some",
                    layout::MAX_MR
                ),
            )
        })?;
        let key = slot | (gen_ << layout::MR_SLOT_BITS);
        let e = layout::mr_entry(slot as usize);
        dev.pub32(e + mr::ACCESS)
            .store(access.bits(), Ordering::Relaxed);
        dev.pub32(e + mr::KIND).store(kind, Ordering::Relaxed);
        dev.pub32(e + mr::FD).store(fd, Ordering::Relaxed);
        dev.pub64(e + mr::ADDR).store(addr, Ordering::Relaxed);
        dev.pub64(e + mr::LEN).store(len as u64, Ordering::Relaxed);
        dev.pub32(e + mr::PD).store(pd, Ordering::Relaxed);
        dev.pub32(e + mr::PARENT_KEY)
            .store(parent_key, Ordering::Relaxed);
        dev.pub64(e + mr::BOUND).store(bound, Ordering::Relaxed);
        dev.in32(layout::pin(slot as usize))
            .store(0, Ordering::Relaxed);
        dev.pub32(e + mr::KEY).store(key, Ordering::Release);
        Ok(SoftMr {
            dev: dev.clone(),
            slot,
            key,
            addr,
            len,
            access,
            pd,
            backing,
        })
    }
}

impl Mr for SoftMr {
    fn addr(&self) -> u64 {
        self.addr
    }

    fn len(&self) -> usize {
        self.len
    }

    fn lkey(&self) -> u32 {
        self.key
    }

    fn rkey(&self) -> u32 {
        self.key
    }

    fn access(&self) -> Access {
        self.access
    }
}

impl Drop for SoftMr {
    fn drop(&mut self) {
        let e = layout::mr_entry(self.slot as usize);
        self.dev.pub32(e + mr::KEY).store(0, Ordering::SeqCst);
        if matches!(self.backing, Backing::User | Backing::Window) {
            // Wait for accesses that passed the key check before we cleared it.
            let pin = self.dev.in32(layout::pin(self.slot as usize));
            let start = Instant::now();
            while pin.load(Ordering::SeqCst) != 0 {
                if start.elapsed() > DEREG_WAIT {
                    tracing::warn!(
                        rkey = self.key,
                        "soft RNIC: a peer kept an access to a deregistered region pinned for \
                         {DEREG_WAIT:?}; deregistering anyway"
                    );
                    break;
                }
                std::thread::yield_now();
            }
        }
        self.dev.mr_slots.free(self.slot);
    }
}

/// A local region looked up by lkey in our own table (trusted: only we write it).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LocalMr {
    pub(crate) base: u64,
    pub(crate) len: u64,
    pub(crate) access: Access,
    pub(crate) pd: u32,
}

impl LocalMr {
    /// Looks up `lkey` in `dev`'s table.
    #[inline]
    pub(crate) fn lookup(dev: &Device, lkey: u32) -> Option<LocalMr> {
        let slot = (lkey & ((1 << layout::MR_SLOT_BITS) - 1)) as usize;
        let e = layout::mr_entry(slot);
        if lkey == 0 || dev.pub32(e + mr::KEY).load(Ordering::Acquire) != lkey {
            return None;
        }
        Some(LocalMr {
            base: dev.pub64(e + mr::ADDR).load(Ordering::Relaxed),
            len: dev.pub64(e + mr::LEN).load(Ordering::Relaxed),
            access: Access::from_bits_truncate(dev.pub32(e + mr::ACCESS).load(Ordering::Relaxed)),
            pd: dev.pub32(e + mr::PD).load(Ordering::Relaxed),
        })
    }

    /// Whether `[addr, addr + len)` is inside the region.
    #[inline]
    pub(crate) fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.base + self.len)
    }
}
