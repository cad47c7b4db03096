//! Registered memory for request payloads ([`crate::Channel::alloc_bytes`]): a large `bytes`
//! field built there is sent from where it lies (the server READs it), not copied into a bulk
//! buffer first.

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;

use crate::buf::BulkBuf;
use crate::verbs::Provider;

/// What the client runtime needs of registered memory lent with a request.
pub(crate) trait RegMem: Send + Sync + 'static {
    /// The bytes.
    fn as_slice(&self) -> &[u8];
    /// The bytes, mutably.
    fn as_mut_slice(&mut self) -> &mut [u8];
    /// The address of the first byte (what the peer names it by, through a window).
    fn addr(&self) -> u64;
    /// The pool (protection domain) the memory belongs to.
    fn pool_id(&self) -> usize;
    /// The memory as what it is (a `BulkBuf` of the client's provider), to lend it.
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<P: Provider> RegMem for BulkBuf<P> {
    fn as_slice(&self) -> &[u8] {
        BulkBuf::as_slice(self)
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        BulkBuf::as_mut_slice(self)
    }

    fn addr(&self) -> u64 {
        BulkBuf::as_slice(self).as_ptr() as u64
    }

    fn pool_id(&self) -> usize {
        BulkBuf::pool_id(self)
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A shared reference to registered memory, as a request keeps it (cloning is an atomic
/// increment).
#[derive(Clone)]
pub(crate) struct RegHandle(pub(crate) Arc<dyn RegMem>);

impl fmt::Debug for RegHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegHandle")
            .field("addr", &format_args!("{:#x}", self.0.addr()))
            .field("len", &self.0.as_slice().len())
            .finish()
    }
}

/// Writable registered memory from [`crate::Channel::alloc_bytes`], not yet shared: fill it
/// (it dereferences to `[u8]`), then [`RegisteredBytesMut::freeze`] it.
pub struct RegisteredBytesMut {
    mem: Box<dyn RegMem>,
}

impl RegisteredBytesMut {
    pub(crate) fn new(mem: Box<dyn RegMem>) -> RegisteredBytesMut {
        RegisteredBytesMut { mem }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.mem.as_slice().len()
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Makes the bytes immutable and shareable: take [`bytes::Bytes`] of them with
    /// [`RegisteredBytes::bytes`] or [`RegisteredBytes::slice`] for messages, and name the
    /// region on each request with [`crate::Request::set_registered`].
    pub fn freeze(self) -> RegisteredBytes {
        let mem: Arc<dyn RegMem> = Arc::from(self.mem);
        let bytes = Bytes::from_owner(Owner(Arc::clone(&mem)));
        RegisteredBytes {
            handle: RegHandle(mem),
            bytes,
        }
    }
}

impl std::ops::Deref for RegisteredBytesMut {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.mem.as_slice()
    }
}

impl std::ops::DerefMut for RegisteredBytesMut {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.mem.as_mut_slice()
    }
}

impl fmt::Debug for RegisteredBytesMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RegisteredBytesMut")
            .field("len", &self.len())
            .finish()
    }
}

/// Immutable registered memory for request payloads (see [`crate::Channel::alloc_bytes`]).
/// Cheap to clone; the memory returns to the connection's pool when the last clone and the
/// last [`Bytes`] taken from it are dropped, and not before the server has read it.
///
/// A request whose large `bytes` field is a [`Bytes`] of this region, and that names the
/// region with [`crate::Request::set_registered`], goes out without a copy: its small fields
/// are staged in a small registered buffer, and the server READs the field straight from
/// here. At most one field per message is sent this way (others are copied), and only on the
/// connection the region was allocated for (after a reconnect the bytes are copied).
#[derive(Clone)]
pub struct RegisteredBytes {
    handle: RegHandle,
    bytes: Bytes,
}

impl RegisteredBytes {
    /// All the bytes, as a [`Bytes`] (no copy; an atomic increment).
    pub fn bytes(&self) -> Bytes {
        self.bytes.clone()
    }

    /// A slice of the bytes, as a [`Bytes`] (no copy).
    ///
    /// # Panics
    /// When the range is out of bounds (as [`Bytes::slice`]).
    pub fn slice(&self, range: impl std::ops::RangeBounds<usize>) -> Bytes {
        self.bytes.slice(range)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the length is zero.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    pub(crate) fn handle(&self) -> &RegHandle {
        &self.handle
    }
}

impl std::ops::Deref for RegisteredBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl AsRef<[u8]> for RegisteredBytes {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl fmt::Debug for RegisteredBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.handle, f)
    }
}

/// The owner behind the [`Bytes`] of a region: keeps the memory registered and alive.
struct Owner(Arc<dyn RegMem>);

impl AsRef<[u8]> for Owner {
    fn as_ref(&self) -> &[u8] {
        self.0.as_slice()
    }
}
