//! Explicit bulk handles, server side (Mercury-style): a client registers memory once and passes
//! `{addr, len, rkey}` inside a request; the handler moves the bytes itself with one-sided RDMA
//! READ or WRITE on the call's connection, through the [`Peer`] of the request.
//!
//! A bulk operation is queued to the shard that owns the connection (from any thread: handlers
//! may hand the `Peer` to spawned tasks), posted there, and its completion resolves the future.
//! The handler reaches the client's memory only while its call runs (a `Peer` kept past it gets
//! `FAILED_PRECONDITION`). An access error (wrong rkey, range outside the lease, missing right) fails the
//! operation with `PERMISSION_DENIED` and, as on any RC queue pair, breaks the connection: the
//! client's calls on it fail with `UNAVAILABLE`.

use std::sync::Arc;

use crossbeam_queue::SegQueue;

use crate::Status;
use crate::buf::BulkBuf;
use crate::doorbell::Doorbell;
use crate::link::LinkKey;
use crate::verbs::{Provider, RemoteMr, Sge};

/// Registered memory of the server, usable as the local side of a bulk operation.
pub trait BulkMem: Send + Sync + 'static {
    /// The bytes.
    fn bytes(&self) -> &[u8];
    /// The bytes, mutably.
    fn bytes_mut(&mut self) -> &mut [u8];
    /// An SGE for `[offset, offset + len)` of the memory.
    fn sge(&self, offset: usize, len: u32) -> Option<Sge>;
}

impl<P: Provider> BulkMem for BulkBuf<P> {
    fn bytes(&self) -> &[u8] {
        self.as_slice()
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self.as_mut_slice()
    }
    fn sge(&self, offset: usize, len: u32) -> Option<Sge> {
        BulkBuf::sge(self, offset, len)
    }
}

/// A registered buffer of the server for bulk operations ([`Peer::buffer`], [`Peer::read`]).
pub struct BulkBuffer(Box<dyn BulkMem>);

impl BulkBuffer {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.0.bytes().len()
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Turns the buffer into `Bytes` without copying (the memory returns to the pool when the
    /// last clone is dropped).
    pub fn into_bytes(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self)
    }
}

impl std::ops::Deref for BulkBuffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl std::ops::DerefMut for BulkBuffer {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }
}

impl AsRef<[u8]> for BulkBuffer {
    fn as_ref(&self) -> &[u8] {
        self.0.bytes()
    }
}

impl std::fmt::Debug for BulkBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BulkBuffer")
            .field("len", &self.len())
            .finish()
    }
}

/// Allocates the shard's registered buffers.
pub(crate) trait BulkAlloc: Send + Sync + 'static {
    fn alloc(&self, len: usize) -> Result<Box<dyn BulkMem>, Status>;
}

struct PoolAlloc<P: Provider>(Arc<crate::buf::BulkPool<P>>);

impl<P: Provider> BulkAlloc for PoolAlloc<P> {
    fn alloc(&self, len: usize) -> Result<Box<dyn BulkMem>, Status> {
        let mut b = self
            .0
            .get(len)
            .map_err(|e| Status::resource_exhausted(format!("bulk buffer of {len} bytes: {e}")))?;
        b.set_len(len);
        Ok(Box::new(b))
    }
}

/// Read or write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    Read,
    Write,
}

/// A bulk operation queued to a shard.
pub(crate) struct BulkOp {
    pub(crate) key: LinkKey,
    /// The call whose handler asked: refused once that call has ended.
    pub(crate) call: crate::wire::CallId,
    pub(crate) kind: OpKind,
    pub(crate) remote: RemoteMr,
    pub(crate) local: Box<dyn BulkMem>,
    pub(crate) len: usize,
    pub(crate) done: tokio::sync::oneshot::Sender<Result<Box<dyn BulkMem>, Status>>,
}

/// What a shard exposes to the [`Peer`]s of its calls.
pub(crate) struct PeerApi {
    pub(crate) ops: SegQueue<BulkOp>,
    /// Stream windows to return to clients (from the handlers' `Streaming`s).
    pub(crate) grants: SegQueue<(LinkKey, crate::wire::CallId, u32)>,
    pub(crate) doorbell: Arc<Doorbell>,
    alloc: Box<dyn BulkAlloc>,
}

/// The host of a server-side inbox: grants window through the shard.
pub(crate) struct ShardInbox {
    pub(crate) api: Arc<PeerApi>,
    pub(crate) key: LinkKey,
    pub(crate) call: crate::wire::CallId,
}

impl crate::streaming::InboxHost for ShardInbox {
    fn grant(&self, n: u32) {
        self.api.grants.push((self.key, self.call, n));
        self.api.doorbell.ring();
    }

    fn abandon(&self) {
        // A handler that drops the client's stream may still answer: nothing to do.
    }
}

impl PeerApi {
    pub(crate) fn new<P: Provider>(
        doorbell: Arc<Doorbell>,
        pool: Arc<crate::buf::BulkPool<P>>,
    ) -> Arc<PeerApi> {
        Arc::new(PeerApi {
            ops: SegQueue::new(),
            grants: SegQueue::new(),
            doorbell,
            alloc: Box::new(PoolAlloc(pool)),
        })
    }
}

/// The connection a request arrived on, for one-sided operations on memory the client
/// registered and advertised (`{addr, len, rkey}`). Cheap to clone; usable from any thread.
#[derive(Clone)]
pub struct Peer {
    api: Arc<PeerApi>,
    key: LinkKey,
    call: crate::wire::CallId,
}

impl std::fmt::Debug for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peer")
            .field("connection", &self.key)
            .field("call", &self.call)
            .finish()
    }
}

impl Peer {
    pub(crate) fn new(api: Arc<PeerApi>, key: LinkKey, call: crate::wire::CallId) -> Peer {
        Peer { api, key, call }
    }

    /// A registered buffer of `len` bytes, to fill and [`Peer::write`].
    ///
    /// # Errors
    /// `RESOURCE_EXHAUSTED` when it cannot be allocated or registered.
    pub fn buffer(&self, len: usize) -> Result<BulkBuffer, Status> {
        self.api.alloc.alloc(len).map(BulkBuffer)
    }

    async fn run(
        &self,
        kind: OpKind,
        remote: RemoteMr,
        local: Box<dyn BulkMem>,
        len: usize,
    ) -> Result<BulkBuffer, Status> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.api.ops.push(BulkOp {
            key: self.key,
            call: self.call,
            kind,
            remote,
            local,
            len,
            done: tx,
        });
        self.api.doorbell.ring_always();
        match rx.await {
            Ok(Ok(buf)) => Ok(BulkBuffer(buf)),
            Ok(Err(status)) => Err(status),
            Err(_) => Err(Status::unavailable(
                "the connection closed during the bulk operation",
            )),
        }
    }

    /// Reads `remote` (all of it) from the client's memory with RDMA READ into a new
    /// registered buffer.
    ///
    /// # Errors
    /// `PERMISSION_DENIED` on a remote access error (bad rkey, out of bounds, no read right:
    /// the connection is then closed), `RESOURCE_EXHAUSTED` when no buffer can be had,
    /// `UNAVAILABLE` when the connection is gone, `FAILED_PRECONDITION` when the call this
    /// `Peer` came with has ended.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the READ; the buffer is freed when it completes.
    pub async fn read(&self, remote: RemoteMr) -> Result<BulkBuffer, Status> {
        let len = usize::try_from(remote.len)
            .map_err(|_| Status::invalid_argument("bulk region larger than the address space"))?;
        let local = self.api.alloc.alloc(len)?;
        self.run(OpKind::Read, remote, local, len).await
    }

    /// Writes `buf` into the client's memory at `remote` with RDMA WRITE (`buf.len()` bytes,
    /// at most `remote.len`). Returns the buffer afterwards.
    ///
    /// # Errors
    /// As [`Peer::read`]; `INVALID_ARGUMENT` when `buf` is larger than `remote`.
    ///
    /// # Cancel safety
    /// Dropping the future does not stop the WRITE; the buffer is freed when it completes.
    pub async fn write(&self, buf: BulkBuffer, remote: RemoteMr) -> Result<BulkBuffer, Status> {
        let len = buf.len();
        if len as u64 > remote.len {
            return Err(Status::invalid_argument(format!(
                "bulk write of {len} bytes into a {}-byte region",
                remote.len
            )));
        }
        self.run(OpKind::Write, remote, buf.0, len).await
    }
}
