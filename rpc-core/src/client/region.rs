//! Explicit regions (Mercury-style bulk handles, client side): registered memory the client
//! owns and lends to the server's handlers for one-sided READ or WRITE, one lease at a time.
//!
//! The region is registered with local rights only, so its own key gives a peer nothing. A
//! [`Lease`] binds a fresh window (`Pd::bind_window_to`) over the lent range with exactly the
//! rights asked, for the connection's peer only; it borrows the region mutably, so Rust code
//! cannot touch the bytes while the server may, and dropping it revokes the key: once the drop
//! returns, no access through it is under way and every later one fails with
//! `REM_ACCESS_ERR`. A lease that is leaked (`mem::forget`) does not leave the memory exposed
//! either: the region revokes a leftover window before it hands out its bytes again.

use std::ops::{Bound, Deref, DerefMut, RangeBounds};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::Status;
use crate::verbs::{Access, ErrorKind, Mr, Pd, Provider, RemoteMr, WindowTarget};

/// What a [`Region`] needs of its registered memory, whatever the provider.
pub(crate) trait RegionMem: Send + Sync + 'static {
    /// The registration (local rights only).
    fn mr(&self) -> &dyn Mr;
    /// A window over `[offset, offset + len)` with `access`, for the connection's peer.
    fn lend(&self, offset: usize, len: usize, access: Access) -> Result<Box<dyn Mr>, Status>;
}

/// Registered memory of provider `P` and what lending it needs.
struct Owned<P: Provider> {
    mr: P::Mr,
    pd: Arc<P::Pd>,
    to: WindowTarget,
}

impl<P: Provider> RegionMem for Owned<P> {
    fn mr(&self) -> &dyn Mr {
        &self.mr
    }

    fn lend(&self, offset: usize, len: usize, access: Access) -> Result<Box<dyn Mr>, Status> {
        match self
            .pd
            .bind_window_to(&self.mr, offset, len, access, self.to)
        {
            Ok(w) => Ok(Box::new(w)),
            Err(e) if e.kind() == ErrorKind::InvalidArgument => Err(Status::invalid_argument(
                format!("cannot lend the region: {e}"),
            )),
            Err(e) => Err(Status::resource_exhausted(format!(
                "cannot lend the region: {e}"
            ))),
        }
    }
}

/// Allocates `len` bytes of registered memory (zeroed, local rights only) that can be lent to
/// the peer `to` names.
pub(crate) fn alloc<P: Provider>(
    pd: &Arc<P::Pd>,
    to: WindowTarget,
    len: usize,
) -> Result<Box<dyn RegionMem>, Status> {
    let mr = pd
        .alloc_mr(len, Access::LOCAL_WRITE)
        .map_err(|e| Status::resource_exhausted(format!("register {len} bytes: {e}")))?;
    Ok(Box::new(Owned::<P> {
        mr,
        pd: Arc::clone(pd),
        to,
    }))
}

/// Client memory registered for the server's one-sided access ([`crate::Channel::alloc_region`]),
/// lent by [`Region::lend`]. Its bytes are yours (`Deref<Target = [u8]>`, `DerefMut`) whenever
/// no [`Lease`] of it lives; deregistered when dropped.
pub struct Region {
    /// The window of a leaked lease, revoked before the bytes are handed out again (dropped
    /// before `mem`).
    leftover: Mutex<Option<Box<dyn Mr>>>,
    /// Whether `leftover` may hold a window (one load on every access to the bytes).
    exposed: AtomicBool,
    mem: Box<dyn RegionMem>,
    _conn: Arc<super::Conn>,
}

impl Region {
    pub(super) fn new(mem: Box<dyn RegionMem>, conn: Arc<super::Conn>) -> Region {
        Region {
            leftover: Mutex::new(None),
            exposed: AtomicBool::new(false),
            mem,
            _conn: conn,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.mr().len()
    }

    /// Whether the region is empty (never: zero-length registrations are refused).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Lends the whole region to the server with `access` ([`Access::REMOTE_READ`] for a
    /// handler that reads it, [`Access::REMOTE_WRITE`] for one that writes it, or both): see
    /// [`Region::lend_range`].
    ///
    /// # Errors
    /// As [`Region::lend_range`].
    pub fn lend(&mut self, access: Access) -> Result<Lease<'_>, Status> {
        self.lend_range(.., access)
    }

    /// Lends `range` of the region to the server with `access` (remote rights only): a fresh
    /// key for exactly that range and those rights, usable by this connection's server only.
    /// Put [`Lease::remote`] into a request; the handler reaches the bytes through
    /// [`crate::server::Peer`]. The server's access ends when the lease is dropped: drop it
    /// when the call returns (a handler still reading or writing then fails with a remote
    /// access error, and its connection breaks, as RC does). While the lease lives the region
    /// is borrowed, so no Rust code can touch the bytes the server may be writing.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for an empty range, one outside the region, or local rights;
    /// `RESOURCE_EXHAUSTED` when no key can be had.
    pub fn lend_range(
        &mut self,
        range: impl RangeBounds<usize>,
        access: Access,
    ) -> Result<Lease<'_>, Status> {
        self.revoke_leftover();
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => s.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&e) => e.saturating_add(1),
            Bound::Excluded(&e) => e,
            Bound::Unbounded => self.len(),
        };
        let window = self.mem.lend(start, end.saturating_sub(start), access)?;
        let remote = window.remote();
        *self.leftover.get_mut().unwrap_or_else(|p| p.into_inner()) = Some(window);
        self.exposed.store(true, Ordering::Release);
        Ok(Lease {
            region: self,
            remote,
        })
    }

    /// Revokes the window of a leaked lease, if any.
    fn revoke_leftover(&self) {
        if self.exposed.load(Ordering::Acquire) {
            let mut w = self.leftover.lock().unwrap_or_else(|p| p.into_inner());
            drop(w.take());
            self.exposed.store(false, Ordering::Release);
        }
    }

    fn bytes(&self) -> *mut u8 {
        self.revoke_leftover();
        self.mem.mr().as_ptr()
    }
}

impl Deref for Region {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        let p = self.bytes();
        // SAFETY: the registration maps `len` bytes while `mem` lives; no key of the region
        // is out (its own has no remote rights, a lease borrows the region mutably, and a
        // leaked lease's window was revoked by `bytes`): only Rust code reaches the bytes.
        unsafe { std::slice::from_raw_parts(p, self.len()) }
    }
}

impl DerefMut for Region {
    fn deref_mut(&mut self) -> &mut [u8] {
        let p = self.bytes();
        // SAFETY: as in `deref`; `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(p, self.len()) }
    }
}

impl AsRef<[u8]> for Region {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl AsMut<[u8]> for Region {
    fn as_mut(&mut self) -> &mut [u8] {
        self
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("len", &self.len())
            .field("lent", &self.exposed.load(Ordering::Relaxed))
            .finish()
    }
}

/// A loan of (part of) a [`Region`] to the server: a key for exactly the lent range and
/// rights, revoked when the lease is dropped. Borrows the region meanwhile.
pub struct Lease<'a> {
    region: &'a mut Region,
    remote: RemoteMr,
}

impl Lease<'_> {
    /// What the server needs: `{addr, len, rkey}` of the lent range.
    pub fn remote(&self) -> RemoteMr {
        self.remote
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        // Revokes the key: once the window is deregistered, nothing reaches the bytes.
        self.region.revoke_leftover();
    }
}

impl std::fmt::Debug for Lease<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease")
            .field("remote", &self.remote)
            .finish()
    }
}
