//! The sans-IO protocol core: frame codec, calls, credits, stream windows, rendezvous and
//! deadlines. No I/O, no clock, no `unsafe`, and no allocation per call: a [`Conn`]'s tables
//! grow only the first times a higher call slot is used (to at most the call table's size), so
//! they follow the calls in flight. Inputs come in
//! with `now` (nanoseconds from any epoch the caller picks), outputs are frame headers and
//! [`Event`]s. The runtime (`server`, `client`) owns the QP, the slots and the clock.
//!
//! # Frames
//!
//! [`frame`]: a 24-byte little-endian base header, optional extensions (deadline, bulk
//! descriptor, landing zone), then metadata, then inline payload. [`decode`] never panics and
//! says what is wrong with bad bytes; [`FrameHeader::encode`] applies the same rules. One SEND
//! may carry several frames back to back (a batch; [`FrameFlags::MORE`], [`next_in_batch`]),
//! and one StreamMessage frame several messages of its stream ([`FrameFlags::PACKED`],
//! [`packed`]).
//!
//! # Calls
//!
//! A client's [`CallId`] is its call-table slot plus a 16-bit generation; the server indexes
//! its own table directly by the client's slot, so every frame finds its call in O(1) and a
//! late frame for a finished call is [`Event::Stale`], never delivered to the slot's next call.
//!
//! ```text
//! client: start_call ─> Idle ─request─> Open ─Response/Status─> Done ─finish─> free
//!                         │              ├─cancel_local─> Cancelled ─(cancel)─ finish
//!                         └──────────────┴─expire─> Expired ─(cancel)─ finish
//! server: Request ─> Open ─response/status─> Closed ─finish─> free
//!                     ├─Cancel─> Cancelled ─finish
//!                     └─expire─> Expired ─finish
//! ```
//!
//! Frame kinds per call kind: unary — Request (with the message), Response or Status.
//! Server-streaming — Request (with the message), StreamMessage*, Status. Client-streaming —
//! Request (metadata only), StreamMessage*, EndOfStream, Response or Status. Bidirectional —
//! Request (metadata only), StreamMessage* both ways, EndOfStream, Status. A server may end a
//! call before the client's stream ends. A Response means status OK.
//!
//! A server entry that is Closed, Cancelled or Expired may be taken over by a newer Request
//! in the same slot; so may an Open one (the client gave it up without a Cancel), which
//! [`Event::Request::replaced`] reports. Hence a client may reuse a slot as soon as it
//! [`Conn::finish`]es the call, and a server's [`Conn::finish`] is tidy-up, never a
//! precondition. A Cancel that waited for credit goes even after its call was finished
//! ([`Conn::cancel_finished`]): the server drops the call, or finds the Cancel stale.
//!
//! # Credits
//!
//! Every SEND consumes one receive slot of the peer (WRITE_WITH_IMM included), whatever the
//! number of frames in it (a batch: [`frame`]'s MORE flag; a frame built with
//! [`Conn::set_joining`] joins the SEND before it and spends no credit). The
//! [`Conn`] counts our send credits and the slots we re-posted but have not reported yet
//! ([`Conn::recv_reposted`]); every header it builds carries those in `credits`.
//! - Data frames (Request, Response, StreamMessage, EndOfStream) only use credits above
//!   `reserved_credits`; control frames (Cancel, Status, WindowUpdate, BulkRelease, GoAway) may
//!   use the reserve but never the last credit; a CreditUpdate may use the last credit. So a
//!   peer that is out of data credits can still cancel, fail calls and return credits, and two
//!   peers can never both be stuck at zero (the last frame of each was a CreditUpdate carrying
//!   at least two credits to the other).
//! - [`Conn::wants_credit_update`] says when to send a CreditUpdate if no other frame is
//!   going out: at least two credits owed (a CreditUpdate costs the peer one slot, so one
//!   credit would be a wash and two peers could ping-pong), and the threshold reached or the
//!   peer, by our count, down to its reserve.
//! - A frame arriving when the peer had no credit by our count, and credits returned beyond
//!   the peer's ring depth, are [`ProtocolError`]s.
//!
//! # Bulk buffers (rendezvous and landing zones)
//!
//! A frame with a bulk descriptor lends a registered buffer to the receiver, who READs it.
//! The receiver gives it back with a BulkRelease for the call, after its READ completed or when
//! it will never read it ([`Event::Stale`] with `bulk`). In addition, a server's final frame
//! (Response, Status) gives back everything the client lent for that call: the server finishes
//! its READs before it answers. [`Event::BulkRelease`] is delivered whatever the call's state:
//! it is about buffers, not calls. A Request's rendezvous payload may be made of up to
//! [`MAX_BULK_PIECES`] ranges ([`FrameFlags::BULK_PIECES`]; the client's staged encoding and
//! the user's registered `bytes` it references); one BulkRelease gives back all of them. A
//! Request with [`FrameFlags::BULK_PENDING`] lends a payload of one range that the client is
//! still writing: the server READs only the prefix that BulkReady frames say is written
//! (growing counts up to the length; [`Conn::request_pending`], [`Conn::bulk_ready`]), so the
//! client's copy of a large field and the server's READ of it overlap. A landing zone is lent with the Request for one response:
//! the server WRITEs a whole Response frame there with WRITE_WITH_IMM (immediate = call id) and
//! the client decodes it from the landing zone ([`FrameFlags::WRITTEN`]).
//!
//! # Deadlines
//!
//! A client call with a timeout expires at `now + timeout`; its Request carries the time left,
//! and the server's copy expires at its own `now + time left`. [`Conn::poll_timeout`] gives
//! the earliest deadline, [`Conn::expire`] moves one expired call at a time (an indexed binary
//! heap keyed by slot: insert, remove and pop in O(log n), nothing allocated).

mod conn;
mod deadlines;
mod error;
pub mod frame;
#[doc(hidden)]
pub mod fuzz;
pub mod packed;

pub use conn::{
    CallId, Config, Conn, Event, MAX_CALLS, MAX_RING_DEPTH, MIN_EAGER_LIMIT, Role, Transfer,
};
pub use error::{ProtocolError, SendError, StartError, WireError};
pub use frame::{
    BASE_HEADER_LEN, Batch, BulkDesc, BulkMore, Frame, FrameFlags, FrameHeader, FrameKind,
    MAX_BULK_PIECES, MAX_HEADER_LEN, WIRE_VERSION, decode, mark_more, next_in_batch,
};

#[cfg(test)]
mod tests;
