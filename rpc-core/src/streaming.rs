//! [`Streaming`]: the stream of messages received on a streaming call, and the inbox behind it.
//!
//! Received stream messages stay in the registered memory they arrived in (a receive slot, or
//! a bulk buffer a large message was READ into) until the consumer takes them; each is decoded
//! when taken. The inbox holds at most the stream window, which the sender never exceeds; the
//! consumer returns window to the sender as it takes messages (every quarter window), so a slow
//! consumer slows its producer and nothing grows without bound.
//!
//! # How large the window is
//!
//! Every stream starts with `STREAM_WINDOW` messages. The consumer sizes the window by
//! bytes, as HTTP/2 does, but counts messages on the wire: when it grants, it opens the window
//! to `STREAM_WINDOW_BYTES` worth of the largest message it has taken, within
//! `STREAM_WINDOW..=STREAM_WINDOW_MAX`. A stream of small messages runs up to 256
//! ahead of its consumer (a window of 16 allowed one burst per round trip: 32 B streams ran
//! at a quarter of the rate), one of large messages keeps 16 (a large message is a loan of
//! the sender's registered memory; senders also keep at most `STREAM_LOANS` of those open
//! per stream, whatever the window). A window that is larger than the target shrinks as the
//! consumer takes messages without granting.

use crate::queue::PopIfAny;
use std::marker::PhantomData;
use std::ops::Range;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use atomic_waker::AtomicWaker;
use bytes::Bytes;
use crossbeam_queue::ArrayQueue;
use futures_core::Stream;
use prost::Message;

use crate::buf::{Lend, RecvSlot, SlotReader};
use crate::wire::packed;
use crate::{Metadata, Status};

/// The window every stream starts with, in messages (both ends use it: handshake 5).
pub(crate) const STREAM_WINDOW: u32 = 16;
/// The most a consumer opens a stream's window to, in messages (both ends: handshake 5).
pub(crate) const STREAM_WINDOW_MAX: u32 = 256;
/// The bytes a consumer lets a stream have in flight: the window is opened to this many
/// bytes of the largest message taken so far (within the two limits above).
pub(crate) const STREAM_WINDOW_BYTES: usize = 256 << 10;
/// The consumer grants window back each time it has taken this fraction of it.
const GRANT_FRACTION: u32 = 4;
/// Large stream messages (rendezvous loans of the sender's registered memory) a sender keeps
/// open per stream, whatever the window: the peer returns them as it reads them.
pub(crate) const STREAM_LOANS: usize = 16;

/// What one received stream frame hands its stream's consumer, still in registered memory.
pub(crate) enum Item {
    /// One message.
    One(Lone),
    /// Several messages packed in one frame ([`crate::wire::packed`]), taken one by one.
    Packed(Packed),
}

/// A message alone in its frame.
pub(crate) enum Lone {
    /// Bytes `start..end` of a receive slot, counted in its connection's lending budget.
    Slot {
        slot: RecvSlot,
        start: usize,
        end: usize,
    },
    /// A whole buffer (a large message READ into a bulk buffer, or a small one copied out of
    /// its slot).
    Owned(Box<dyn AsRef<[u8]> + Send>),
}

/// The messages of a packed frame not taken yet: the frame's receive slot as one shared
/// `Bytes` (or a copy of its payload, past the connection's lending budget), which every
/// message taken is decoded from and whose `bytes` fields borrow it, whatever their size: one
/// allocation per frame, none per message. The slot goes back to its ring when the last
/// message (and the last field kept from one) is dropped; it is counted in the lending
/// budget meanwhile, as a slot holding one message is.
pub(crate) struct Packed {
    bytes: Bytes,
    /// Where the next message's length starts, and where the payload ends, in `bytes`.
    at: usize,
    end: usize,
    /// Messages left.
    left: u32,
}

impl Packed {
    /// The next message, decoded, and its length; `None` when none is left.
    #[inline(always)]
    fn take<T: Message + Default>(&mut self) -> Option<(usize, Result<T, Status>)> {
        if self.left == 0 {
            return None;
        }
        // The decoder checked the packing (`wire::packed::check`): a miss is a bug, reported
        // as the stream's error rather than trusted.
        let Some((start, end)) = self
            .bytes
            .get(..self.end)
            .and_then(|p| packed::next(p, self.at))
        else {
            self.left = 0;
            return Some((
                0,
                Err(Status::internal("a packed stream frame ended early")),
            ));
        };
        self.at = end;
        self.left -= 1;
        let r = T::decode(Slice {
            whole: &self.bytes,
            pos: start,
            end,
        })
        .map_err(decode_error);
        Some((end - start, r))
    }
}

/// A [`bytes::Buf`] over `whole[pos..end]` whose `bytes` fields are slices of `whole`: one
/// reference count taken per field, none for the message itself.
struct Slice<'a> {
    whole: &'a Bytes,
    pos: usize,
    end: usize,
}

impl bytes::Buf for Slice<'_> {
    fn remaining(&self) -> usize {
        self.end - self.pos
    }

    fn chunk(&self) -> &[u8] {
        &self.whole[self.pos..self.end]
    }

    fn advance(&mut self, cnt: usize) {
        assert!(
            cnt <= self.remaining(),
            "advance past the end of the message"
        );
        self.pos += cnt;
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(
            len <= self.remaining(),
            "copy_to_bytes past the end of the message"
        );
        let b = self.whole.slice(self.pos..self.pos + len);
        self.pos += len;
        b
    }
}

fn decode_error(e: prost::DecodeError) -> Status {
    Status::internal(format!("failed to decode stream message: {e}"))
}

impl std::fmt::Debug for Item {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Item::One(Lone::Slot { slot, start, end }) => {
                write!(f, "Item::One(Slot({slot:?}, {start}..{end}))")
            }
            Item::One(Lone::Owned(b)) => {
                write!(f, "Item::One(Owned({} bytes))", b.as_ref().as_ref().len())
            }
            Item::Packed(p) => write!(f, "Item::Packed({} left)", p.left),
        }
    }
}

impl Item {
    /// The stream message in bytes `start..end` of `slot`: kept in the slot (zero copy) while
    /// the connection's lending budget allows ([`RecvSlot::try_lend`]), copied out past it, so
    /// that stalled streams never hold the receive ring (the slot goes back at once, and what
    /// the copies take is bounded by the stream windows).
    pub(crate) fn from_slot(mut slot: RecvSlot, start: usize, end: usize) -> Item {
        if slot.try_lend() {
            return Item::One(Lone::Slot { slot, start, end });
        }
        // Clamped as `SlotReader` clamps (the parser checked the range already).
        let b = slot.bytes();
        let end = end.min(b.len());
        let copy = crate::memcopy::to_vec(b.get(start.min(end)..end).unwrap_or_default());
        Item::owned(Box::new(copy))
    }

    /// A message in a whole buffer of its own.
    pub(crate) fn owned(b: Box<dyn AsRef<[u8]> + Send>) -> Item {
        Item::One(Lone::Owned(b))
    }

    /// The stream message(s) of a frame whose payload is bytes `payload` of `slot`: one
    /// message ([`Item::from_slot`]) when `packed` is 0, else `packed` messages packed there
    /// (kept in the slot, or copied out past the lending budget, as one message is).
    pub(crate) fn from_frame(mut slot: RecvSlot, payload: Range<usize>, packed: u32) -> Item {
        if packed == 0 {
            return Item::from_slot(slot, payload.start, payload.end);
        }
        let (bytes, at, end) = if slot.try_lend() {
            (Bytes::from_owner(slot), payload.start, payload.end)
        } else {
            let copy = crate::memcopy::to_vec(slot.bytes().get(payload).unwrap_or_default());
            let n = copy.len();
            (Bytes::from(copy), 0, n)
        };
        Item::Packed(Packed {
            bytes,
            at,
            end,
            left: packed,
        })
    }
}

struct OwnedItem(Box<dyn AsRef<[u8]> + Send>);

impl AsRef<[u8]> for OwnedItem {
    fn as_ref(&self) -> &[u8] {
        self.0.as_ref().as_ref()
    }
}

impl Lend for OwnedItem {}

impl Lone {
    /// The message's bytes.
    fn len(&self) -> usize {
        match self {
            Lone::Slot { start, end, .. } => end.saturating_sub(*start),
            Lone::Owned(b) => b.as_ref().as_ref().len(),
        }
    }

    fn decode<T: Message + Default>(self) -> Result<T, Status> {
        let r = match self {
            Lone::Slot { slot, start, end } => T::decode(SlotReader::new(slot, start, end)),
            Lone::Owned(b) => {
                let n = b.as_ref().as_ref().len();
                T::decode(SlotReader::new(OwnedItem(b), 0, n))
            }
        };
        r.map_err(decode_error)
    }
}

/// What the inbox asks of the connection's owner (the client driver or the server shard).
pub(crate) trait InboxHost: Send + Sync + 'static {
    /// Return `n` messages of window to the sender.
    fn grant(&self, n: u32);
    /// The consumer went away (before or after the end): give the call up if it still runs,
    /// and let go of what it holds.
    fn abandon(&self);
    /// The consumer found nothing and is about to wait. A host that nobody drives but its
    /// callers (the client's `ClientPoller::Caller`) makes progress here and has the consumer
    /// polled again; others do nothing.
    fn waiting(&self, _cx: &mut Context<'_>) {}
}

/// The receiving side of one call's message stream.
pub(crate) struct Inbox {
    items: ArrayQueue<Item>,
    waker: AtomicWaker,
    ended: AtomicBool,
    end: OnceLock<Option<Status>>,
    metadata: OnceLock<Metadata>,
    trailers: OnceLock<Metadata>,
    /// The consumer's own counters (only the consumer reads or writes them): messages taken
    /// since the last grant, the window the sender was last allowed (messages in flight, queued
    /// and taken since that grant included), and the largest message taken.
    consumed: AtomicU32,
    window: AtomicU32,
    largest: AtomicUsize,
    /// The window the stream starts with and the most it is opened to.
    initial: u32,
    max: u32,
    host: OnceLock<Box<dyn InboxHost>>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox")
            .field("queued", &self.items.len())
            .field("ended", &self.ended.load(Ordering::Relaxed))
            .finish()
    }
}

impl Inbox {
    /// An inbox for a stream whose window starts at `initial` messages and may be opened to
    /// `max` (the connection's `stream_window` and `stream_window_max`).
    pub(crate) fn new(initial: u32, max: u32) -> Arc<Inbox> {
        let initial = initial.max(1);
        let max = max.max(initial);
        Arc::new(Inbox {
            items: ArrayQueue::new(max as usize + 1),
            waker: AtomicWaker::new(),
            ended: AtomicBool::new(false),
            end: OnceLock::new(),
            metadata: OnceLock::new(),
            trailers: OnceLock::new(),
            consumed: AtomicU32::new(0),
            window: AtomicU32::new(initial),
            largest: AtomicUsize::new(0),
            initial,
            max,
            host: OnceLock::new(),
        })
    }

    /// Connects the inbox to its host (once).
    pub(crate) fn set_host(&self, host: Box<dyn InboxHost>) {
        let _ = self.host.set(host);
    }

    /// Producer: a message arrived. Returns it back when the inbox is full (the sender broke
    /// the window).
    pub(crate) fn push(&self, item: Item) -> Result<(), Item> {
        self.items.push(item)?;
        self.waker.wake();
        Ok(())
    }

    /// Producer: the peer's metadata for the stream (first frame).
    pub(crate) fn set_metadata(&self, md: Metadata) {
        let _ = self.metadata.set(md);
    }

    /// Producer: the trailers of a stream that ended OK (set before [`Inbox::finish`]).
    pub(crate) fn set_trailers(&self, md: Metadata) {
        let _ = self.trailers.set(md);
    }

    /// Whether the stream has begun for the consumer: a message is waiting or it has ended
    /// (the response headers are known then). Registers the waker otherwise.
    fn poll_started(&self, cx: &mut Context<'_>) -> Poll<()> {
        for attempt in 0..2 {
            if !self.items.is_empty() || self.ended.load(Ordering::Acquire) {
                return Poll::Ready(());
            }
            if attempt == 0 {
                self.waker.register(cx.waker());
            }
        }
        if let Some(h) = self.host.get() {
            h.waiting(cx);
        }
        Poll::Pending
    }

    /// Producer: the stream ended, cleanly (`None`) or with an error status.
    pub(crate) fn finish(&self, status: Option<Status>) {
        let _ = self.end.set(status);
        self.ended.store(true, Ordering::Release);
        self.waker.wake();
    }

    /// The next item (the consumer counts each message it takes with [`Inbox::took_one`]).
    fn poll_item(&self, cx: &mut Context<'_>) -> Poll<Option<Result<Item, Status>>> {
        for attempt in 0..2 {
            if let Some(item) = self.items.pop_if_any() {
                return Poll::Ready(Some(Ok(item)));
            }
            if self.ended.load(Ordering::Acquire) {
                // Items pushed before `finish` are visible (push happens-before the flag).
                if let Some(item) = self.items.pop_if_any() {
                    return Poll::Ready(Some(Ok(item)));
                }
                return Poll::Ready(match self.end.get() {
                    Some(Some(status)) => Some(Err(status.clone())),
                    _ => None,
                });
            }
            if attempt == 0 {
                self.waker.register(cx.waker());
            }
        }
        if let Some(h) = self.host.get() {
            h.waiting(cx);
        }
        Poll::Pending
    }

    /// The consumer took a message of `len` bytes: every quarter window it grants the sender
    /// what it took, resized to the target (see the module's documentation). A quarter, not a
    /// half: the sender gets window back while most of what it sent is still queued, so a
    /// stream of small messages (packed a burst to a frame) never waits a round trip with
    /// nothing to send (32 B server streaming: 11.6 M messages/s with half-window grants,
    /// 13.3 M with quarter ones).
    fn took_one(&self, len: usize) {
        // Only the consumer (`&mut Streaming`) gets here: plain loads and stores suffice.
        let n = self.consumed.load(Ordering::Relaxed) + 1;
        let largest = self.largest.load(Ordering::Relaxed).max(len);
        self.largest.store(largest, Ordering::Relaxed);
        let window = self.window.load(Ordering::Relaxed);
        if n < window.div_ceil(GRANT_FRACTION) {
            self.consumed.store(n, Ordering::Relaxed);
            return;
        }
        self.consumed.store(0, Ordering::Relaxed);
        let target = window_for(largest, self.initial, self.max);
        // After a grant of `g` the sender may have `window - n + g` messages out.
        let grant = (n + target).saturating_sub(window);
        if grant == 0 {
            self.window.store(window - n, Ordering::Relaxed);
            return;
        }
        self.window.store(target, Ordering::Relaxed);
        if !self.ended.load(Ordering::Acquire)
            && let Some(h) = self.host.get()
        {
            h.grant(grant);
        }
    }

    fn dropped(&self) {
        if let Some(h) = self.host.get() {
            h.abandon();
        }
    }
}

/// The window (messages) for a stream whose largest message so far is `largest` bytes:
/// `STREAM_WINDOW_BYTES` of them, within `initial..=max`.
fn window_for(largest: usize, initial: u32, max: u32) -> u32 {
    let n = STREAM_WINDOW_BYTES / largest.max(1);
    n.clamp(initial as usize, max as usize) as u32
}

/// A stream of `T`s from another source (tests, adapters).
type LocalStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

enum Source<T> {
    Inbox(Arc<Inbox>),
    Local(LocalStream<T>),
    /// Over; the inbox is kept (after its host was told) for its metadata and trailers.
    Done(Option<Arc<Inbox>>),
}

/// Messages of type `T` arriving on a streaming call, ending with the call's status.
///
/// Dropping it before the end cancels the call (the peer is told). On the client it keeps its
/// connection open while it lives, even when every `Channel` handle is gone.
pub struct Streaming<T> {
    source: Source<T>,
    /// The messages of a packed frame taken from the inbox and not all given out yet.
    packed: Option<Packed>,
    /// What must live as long as the stream (the client connection it arrives on).
    keep: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// The method called (client streams): the runtime's unknown-method status names it.
    path: Option<&'static str>,
    _marker: PhantomData<fn() -> T>,
}

impl<T> std::fmt::Debug for Streaming<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match &self.source {
            Source::Inbox(i) => format!("{i:?}"),
            Source::Local(_) => "local".to_owned(),
            Source::Done(_) => "done".to_owned(),
        };
        f.debug_struct("Streaming").field("source", &s).finish()
    }
}

impl<T> Streaming<T> {
    pub(crate) fn from_inbox(inbox: Arc<Inbox>) -> Streaming<T> {
        Streaming {
            source: Source::Inbox(inbox),
            packed: None,
            keep: None,
            path: None,
            _marker: PhantomData,
        }
    }

    /// Keeps `owner` alive as long as the stream: a client stream holds its connection, as
    /// an unary call does while it runs, so dropping every `Channel` handle strands no stream.
    pub(crate) fn keep_alive(mut self, owner: Arc<dyn std::any::Any + Send + Sync>) -> Self {
        self.keep = Some(owner);
        self
    }

    /// The stream of a call of `path`: an unknown-method status names the path.
    pub(crate) fn for_method(mut self, path: &'static str) -> Self {
        self.path = Some(path);
        self
    }

    /// A `Streaming` fed by any stream: for adapters (serving a handler through another
    /// transport) and for testing handlers without a connection.
    pub fn from_stream(s: impl Stream<Item = Result<T, Status>> + Send + 'static) -> Streaming<T> {
        Streaming {
            source: Source::Local(Box::pin(s)),
            packed: None,
            keep: None,
            path: None,
            _marker: PhantomData,
        }
    }

    /// Metadata the peer sent with its first stream message (or with the end of a stream
    /// that had none), once it has arrived. A server-streaming call's response headers are
    /// also on the `Response` the call returned.
    pub fn metadata(&self) -> Option<&Metadata> {
        match &self.source {
            Source::Inbox(i) | Source::Done(Some(i)) => i.metadata.get(),
            _ => None,
        }
    }

    /// Waits until the stream has begun (a message arrived, or the end): a server-streaming
    /// call returns then, with the response headers, as tonic's does.
    ///
    /// # Errors
    /// The call's status when it failed before its first message (gRPC's trailers-only
    /// response, which tonic's call returns as an error too).
    pub(crate) async fn started(&self) -> Result<(), Status> {
        if let Source::Inbox(inbox) = &self.source {
            std::future::poll_fn(|cx| inbox.poll_started(cx)).await;
            if inbox.items.is_empty()
                && inbox.ended.load(Ordering::Acquire)
                && let Some(Some(status)) = inbox.end.get()
            {
                return Err(status.clone());
            }
        }
        Ok(())
    }
}

impl<T: Message + Default> Streaming<T> {
    /// The next message, `Ok(None)` at the end of the stream, or the call's error status.
    ///
    /// # Errors
    /// The call's [`Status`] when it ended with one, or a decoding failure.
    ///
    /// # Cancel safety
    /// Cancel safe: a message is never lost when the future is dropped.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        match std::future::poll_fn(|cx| Pin::new(&mut *self).poll_next(cx)).await {
            Some(Ok(m)) => Ok(Some(m)),
            Some(Err(e)) => Err(e),
            None => Ok(None),
        }
    }

    /// The trailers the server sent with the stream's OK end: waits for the end, dropping
    /// the messages not yet taken (as tonic's `Streaming::trailers`). `Ok(None)` for a stream
    /// without trailers (a client's stream, as seen by a handler, never has any).
    ///
    /// # Errors
    /// The call's [`Status`] when it ended with one, or a decoding failure.
    pub async fn trailers(&mut self) -> Result<Option<Metadata>, Status> {
        while self.message().await?.is_some() {}
        Ok(match &self.source {
            Source::Done(Some(inbox)) => inbox.trailers.get().filter(|t| !t.is_empty()).cloned(),
            _ => None,
        })
    }
}

impl<T: Message + Default> Stream for Streaming<T> {
    type Item = Result<T, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        // The rest of a packed frame first: a decoded message goes straight out (the fast
        // path of a stream of small messages, one frame carrying many).
        if let (Some(p), Source::Inbox(inbox)) = (&mut this.packed, &this.source) {
            match p.take::<T>() {
                Some((len, Ok(m))) => {
                    inbox.took_one(len);
                    return Poll::Ready(Some(Ok(m)));
                }
                Some((len, Err(e))) => {
                    inbox.took_one(len);
                    return this.over_if_done(Poll::Ready(Some(Err(e))));
                }
                None => {}
            }
        }
        this.packed = None;
        let r = match &mut this.source {
            Source::Inbox(inbox) => match inbox.poll_item(cx) {
                Poll::Ready(Some(Ok(Item::Packed(mut p)))) => match p.take::<T>() {
                    Some((len, r)) => {
                        inbox.took_one(len);
                        this.packed = Some(p);
                        Poll::Ready(Some(r))
                    }
                    None => Poll::Ready(Some(Err(Status::internal(
                        "a packed stream frame with no message",
                    )))),
                },
                Poll::Ready(Some(Ok(Item::One(one)))) => {
                    inbox.took_one(one.len());
                    Poll::Ready(Some(one.decode::<T>()))
                }
                Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(match this.path {
                    Some(path) => e.for_method(path),
                    None => e,
                }))),
                Poll::Ready(None) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            },
            Source::Local(s) => s.as_mut().poll_next(cx),
            Source::Done(_) => Poll::Ready(None),
        };
        this.over_if_done(r)
    }
}

impl<T> Streaming<T> {
    /// `r`, after letting the host free the call when `r` ends the stream for the consumer
    /// (its end, or an error).
    fn over_if_done(
        &mut self,
        r: Poll<Option<Result<T, Status>>>,
    ) -> Poll<Option<Result<T, Status>>> {
        if let Poll::Ready(None) | Poll::Ready(Some(Err(_))) = r
            && let Source::Inbox(inbox) = &self.source
        {
            inbox.dropped();
            let inbox = Arc::clone(inbox);
            self.source = Source::Done(Some(inbox));
        }
        r
    }
}

impl<T> Unpin for Streaming<T> {}

impl<T> Drop for Streaming<T> {
    fn drop(&mut self) {
        if let Source::Inbox(inbox) = &self.source {
            inbox.dropped();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Host {
        grants: Mutex<Vec<u32>>,
        abandoned: AtomicBool,
    }
    impl InboxHost for Arc<Host> {
        fn grant(&self, n: u32) {
            self.grants.lock().unwrap().push(n);
        }
        fn abandon(&self) {
            self.abandoned.store(true, Ordering::SeqCst);
        }
    }

    fn owned(v: u32) -> Item {
        Item::owned(Box::new(M { v }.encode_to_vec()))
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct M {
        #[prost(uint32, tag = "1")]
        v: u32,
    }

    #[tokio::test]
    async fn messages_then_end_and_grants_every_quarter_window() {
        let inbox = Inbox::new(8, 8);
        let host = Arc::new(Host::default());
        inbox.set_host(Box::new(Arc::clone(&host)));
        let mut s: Streaming<M> = Streaming::from_inbox(Arc::clone(&inbox));
        for v in 0..4 {
            inbox.push(owned(v)).unwrap();
        }
        for v in 0..4 {
            assert_eq!(s.message().await.unwrap(), Some(M { v }));
        }
        assert_eq!(*host.grants.lock().unwrap(), vec![2, 2]);
        inbox.push(owned(4)).unwrap();
        inbox.finish(None);
        assert_eq!(s.message().await.unwrap(), Some(M { v: 4 }));
        assert_eq!(s.message().await.unwrap(), None);
        assert_eq!(
            *host.grants.lock().unwrap(),
            vec![2, 2],
            "no grant after the end"
        );
        drop(s);
        assert!(
            host.abandoned.load(Ordering::SeqCst),
            "the host learns the consumer is gone"
        );
    }

    #[tokio::test]
    async fn an_error_status_ends_the_stream_and_dropping_early_abandons() {
        let inbox = Inbox::new(2, 2);
        let host = Arc::new(Host::default());
        inbox.set_host(Box::new(Arc::clone(&host)));
        let mut s: Streaming<M> = Streaming::from_inbox(Arc::clone(&inbox));
        inbox.push(owned(9)).unwrap();
        assert_eq!(s.message().await.unwrap(), Some(M { v: 9 }));
        drop(s);
        assert!(host.abandoned.load(Ordering::SeqCst));

        let inbox = Inbox::new(2, 2);
        let mut s: Streaming<M> = Streaming::from_inbox(Arc::clone(&inbox));
        inbox.finish(Some(Status::aborted("boom")));
        assert_eq!(s.message().await.unwrap_err().code(), crate::Code::Aborted);
        assert_eq!(s.message().await.unwrap(), None);
    }

    fn sized(len: usize) -> Item {
        Item::owned(Box::new(vec![0u8; len]))
    }

    /// Takes `n` messages of `len` bytes (pushed as room allows): the grants made meanwhile.
    fn take(inbox: &Arc<Inbox>, host: &Host, n: usize, len: usize) -> Vec<u32> {
        let before = host.grants.lock().unwrap().len();
        let waker = futures_util::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        for _ in 0..n {
            inbox.push(sized(len)).unwrap();
            let Poll::Ready(Some(Ok(Item::One(one)))) = inbox.poll_item(&mut cx) else {
                panic!("no lone message");
            };
            inbox.took_one(one.len());
        }
        host.grants.lock().unwrap()[before..].to_vec()
    }

    #[test]
    fn the_window_opens_for_small_messages_and_closes_for_large_ones() {
        assert_eq!(window_for(32, 16, 256), 256);
        assert_eq!(window_for(4096, 16, 256), 64);
        assert_eq!(window_for(1 << 20, 16, 256), 16);
        let inbox = Inbox::new(16, 256);
        let host = Arc::new(Host::default());
        inbox.set_host(Box::new(Arc::clone(&host)));
        // Small messages: the first grant (after a quarter of the initial window) opens it
        // to the most; then a quarter of it is granted back each time.
        assert_eq!(take(&inbox, &host, 4, 32), vec![4 + 256 - 16]);
        assert_eq!(take(&inbox, &host, 128, 32), vec![64, 64]);
        // Large messages: no grant until the window has shrunk to its target (16), then a
        // quarter of that, each time.
        let large = take(&inbox, &host, 243, 1 << 20);
        assert_eq!(large.iter().sum::<u32>(), 243 + 16 - 256, "{large:?}");
        assert_eq!(inbox.window.load(Ordering::Relaxed), 16);
        assert_eq!(take(&inbox, &host, 16, 1 << 20), vec![4, 4, 4, 4]);
    }

    /// `msgs` packed as a sender packs them, in a plain `Vec` slot of a soft arena-less test:
    /// the payload bytes.
    fn packed_payload(msgs: &[M]) -> Vec<u8> {
        let mut p = Vec::new();
        for m in msgs {
            let b = m.encode_to_vec();
            p.extend_from_slice(&(b.len() as u32).to_le_bytes());
            p.extend_from_slice(&b);
        }
        p
    }

    /// A packed item of `left` messages whose payload is `payload`.
    fn packed(payload: Vec<u8>, left: u32) -> Item {
        let end = payload.len();
        Item::Packed(Packed {
            bytes: Bytes::from(payload),
            at: 0,
            end,
            left,
        })
    }

    #[tokio::test]
    async fn packed_messages_come_out_one_by_one_and_count_in_the_window() {
        let inbox = Inbox::new(8, 8);
        let host = Arc::new(Host::default());
        inbox.set_host(Box::new(Arc::clone(&host)));
        let mut s: Streaming<M> = Streaming::from_inbox(Arc::clone(&inbox));
        let msgs: Vec<M> = (0..3).map(|v| M { v }).collect();
        let payload = packed_payload(&msgs);
        inbox.push(packed(payload, 3)).unwrap();
        inbox.push(owned(3)).unwrap();
        for v in 0..4 {
            assert_eq!(s.message().await.unwrap(), Some(M { v }));
        }
        inbox.finish(None);
        assert_eq!(s.message().await.unwrap(), None);
        assert_eq!(
            *host.grants.lock().unwrap(),
            vec![2, 2],
            "each packed message counts as one taken (a grant every 2 of a window of 8)"
        );
    }

    #[tokio::test]
    async fn a_packed_message_that_does_not_decode_fails_the_stream() {
        let inbox = Inbox::new(4, 4);
        let mut s: Streaming<M> = Streaming::from_inbox(Arc::clone(&inbox));
        // A length that says 5 bytes of garbage (a truncated varint field).
        let mut payload = 5u32.to_le_bytes().to_vec();
        payload.extend_from_slice(&[0x08, 0xff, 0xff, 0xff, 0xff]);
        inbox.push(packed(payload, 1)).unwrap();
        let e = s.message().await.unwrap_err();
        assert_eq!(e.code(), crate::Code::Internal);
        assert!(e.message().contains("decode stream message"), "{e}");

        // A bad message in the middle of a frame ends the stream there too, as a bad message
        // alone does: the messages after it are not handed out.
        let inbox = Inbox::new(8, 8);
        let mut s: Streaming<M> = Streaming::from_inbox(Arc::clone(&inbox));
        let mut payload = packed_payload(&[M { v: 1 }]);
        payload.extend_from_slice(&5u32.to_le_bytes());
        payload.extend_from_slice(&[0x08, 0xff, 0xff, 0xff, 0xff]);
        payload.extend_from_slice(&packed_payload(&[M { v: 3 }]));
        inbox.push(packed(payload, 3)).unwrap();
        assert_eq!(s.message().await.unwrap(), Some(M { v: 1 }));
        assert_eq!(s.message().await.unwrap_err().code(), crate::Code::Internal);
        assert_eq!(s.message().await.unwrap(), None, "over after the error");
    }

    #[tokio::test]
    async fn from_stream_passes_items_through() {
        let items = vec![Ok(M { v: 1 }), Err(Status::not_found("x"))];
        let st = futures_util::stream::iter(items);
        let mut s = Streaming::from_stream(st);
        assert_eq!(s.message().await.unwrap(), Some(M { v: 1 }));
        assert!(s.message().await.is_err());
    }
}
