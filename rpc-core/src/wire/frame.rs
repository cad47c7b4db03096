//! The frame codec: a fixed 24-byte little-endian base header, optional extensions, then
//! metadata bytes, then inline payload bytes.
//!
//! ```text
//! off size field
//! 0   1   version (= WIRE_VERSION)
//! 1   1   kind (FrameKind)
//! 2   2   flags (FrameFlags)
//! 4   4   call_id (0 for connection frames: CreditUpdate, GoAway)
//! 8   4   aux: method id (Request), status code (Status), grant (WindowUpdate), credits to
//!             keep or surrendered (CreditUpdate with RECLAIM), messages packed in the
//!             payload (StreamMessage with PACKED), low half of the bytes ready
//!             (BulkReady), 0 else
//! 12  2   credits: receive slots the sender re-posted for the receiver since its last report
//! 14  2   metadata_len
//! 16  4   payload_len (inline payload bytes after header + extensions + metadata)
//! 20  4   seq (stream message number: StreamMessage, EndOfStream; high half of the bytes
//!             ready: BulkReady; 0 else)
//! -- extensions, in this order, each present when its flag is set --
//! HAS_DEADLINE  u64 timeout_ns (time left, relative)                      Request only
//! HAS_BULK      BulkDesc {addr u64, len u64, rkey u32, pad u32 = 0}        Request, Response,
//!               (payload to RDMA-READ; payload_len is then 0)              StreamMessage
//! BULK_PIECES   u32 count (1 ..= MAX_BULK_PIECES - 1), u32 pad = 0,          Request only,
//!               then `count` more BulkDescs: the payload is the bulk range    with HAS_BULK
//!               followed by these, READ in order into one buffer
//! HAS_LANDING   BulkDesc (where the server may RDMA-WRITE the response)   Request only
//! ```
//!
//! [`decode`] validates everything a peer could get wrong and never panics; [`FrameHeader::
//! encode`] applies the same rules, so we never send what a peer would refuse.
//!
//! # Batches: several frames in one SEND
//!
//! One SEND (one receive slot of the peer) may carry several frames back to back: every frame
//! but the last has [`FrameFlags::MORE`] set, and the next frame starts right where it ends
//! (its header, extensions, metadata and payload, no padding). The SEND's byte length is the
//! sum of its frames' lengths.
//!
//! ```text
//! receive slot: [ frame 0 (MORE) | frame 1 (MORE) | .. | frame n-1 | .. unused .. ]
//!               0                                                  ^ byte length of the SEND
//! ```
//!
//! [`next_in_batch`] (and the [`Batch`] iterator built on it) says where the next frame starts
//! and refuses what a peer could get wrong: MORE on a frame that ends the SEND
//! ([`WireError::BatchTruncated`]), bytes after a frame without MORE
//! ([`WireError::BatchTrailing`]). Each frame's own lengths are checked against the bytes left
//! by [`decode`], so a frame never reaches past the SEND. A frame written into a landing zone
//! ([`FrameFlags::WRITTEN`]) is always alone. A batch costs the receiver one receive slot
//! whatever its frames: [`crate::wire::Conn::handle_frame`] counts a slot only for a frame
//! that does not follow a MORE frame. Batches are version 2 of the wire format: a version-1
//! peer refuses every frame with [`WireError::BadVersion`], and the handshake refuses it first.
//!
//! # Packed stream messages
//!
//! A StreamMessage frame with [`FrameFlags::PACKED`] carries `aux` (at least 1) consecutive
//! messages of its stream, numbered `seq ..= seq + aux - 1`: its payload is each message as a
//! little-endian `u32` length and that many bytes, nothing before, between or after them
//! ([`super::packed`]). A sender appends the small messages of a burst to the stream's last
//! frame while it is not sent yet, so a receiver handles one header, one window check and one
//! hand-off per burst rather than per message. [`decode`] checks that the lengths tile the
//! payload exactly. Version 4 of the wire format.
//!
//! # Payloads that become ready while they are read
//!
//! A Request with [`FrameFlags::BULK_PENDING`] lends its one bulk range before its bytes are
//! all written: the client copies a large message into the buffer while the server READs what
//! is ready, so the copy and the transfer overlap. The server READs nothing of it until
//! BulkReady frames for the call say how many bytes, from the start, are ready (a count that
//! only grows, up to the range's length; the last one is the whole length). Version 5.

use std::fmt;

use super::WireError;

/// The wire protocol version carried in every frame.
///
/// 2: batches ([`FrameFlags::MORE`]); a version-1 peer would have read only the first frame
/// of a SEND. 3: credit reclaims ([`FrameFlags::RECLAIM`]), for receivers that grant credits
/// from a receive pool shared by many connections. 4: packed stream messages
/// ([`FrameFlags::PACKED`]). 5: payloads read while they are written
/// ([`FrameFlags::BULK_PENDING`], [`FrameKind::BulkReady`]).
pub const WIRE_VERSION: u8 = 5;
/// Bytes of the fixed base header.
pub const BASE_HEADER_LEN: usize = 24;
/// Bytes of the deadline extension.
pub const DEADLINE_EXT_LEN: usize = 8;
/// Bytes of a [`BulkDesc`] extension (bulk or landing).
pub const BULK_EXT_LEN: usize = 24;
/// Most remote ranges the payload of one rendezvous Request may be made of: the bulk
/// descriptor and up to `MAX_BULK_PIECES - 1` more in the pieces extension
/// ([`FrameFlags::BULK_PIECES`]).
pub const MAX_BULK_PIECES: usize = 3;
/// Bytes of the pieces extension before its descriptors (count and padding).
pub const PIECES_EXT_BASE: usize = 8;
/// The longest header: base plus every extension.
pub const MAX_HEADER_LEN: usize = BASE_HEADER_LEN
    + DEADLINE_EXT_LEN
    + 2 * BULK_EXT_LEN
    + PIECES_EXT_BASE
    + (MAX_BULK_PIECES - 1) * BULK_EXT_LEN;

const _: () = assert!(MAX_HEADER_LEN == 136);

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// Client -> server: opens a call (method id in `aux`). For unary and server-streaming
    /// calls it carries the request message; for client-streaming and bidirectional calls it
    /// carries only metadata and the messages follow as [`FrameKind::StreamMessage`].
    Request = 1,
    /// Server -> client: the one response message of a unary or client-streaming call; it
    /// also means status OK and ends the call.
    Response = 2,
    /// One message of a stream, either direction; `seq` numbers them from 0 per direction.
    StreamMessage = 3,
    /// Client -> server: the client's stream is over (half-close); `seq` is the number of
    /// messages it sent.
    EndOfStream = 4,
    /// Client -> server: the client gave the call up.
    Cancel = 5,
    /// Either way, connection-wide: carries only `credits`.
    CreditUpdate = 6,
    /// Server -> client: the call's outcome (code in `aux`, UTF-8 message as payload, trailers
    /// as metadata); ends the call.
    Status = 7,
    /// Either way: the receiver of a stream grants `aux` more messages.
    WindowUpdate = 8,
    /// Either way: the receiver finished reading a bulk payload the sender advertised for the
    /// call (or will never read it): the sender may reuse the buffer.
    BulkRelease = 9,
    /// Server -> client, connection-wide: the server is draining; no new calls.
    GoAway = 10,
    /// Client -> server: the first `aux | seq << 32` bytes (nonzero) of the call's pending
    /// rendezvous payload ([`FrameFlags::BULK_PENDING`]) are written and may be READ.
    BulkReady = 11,
}

impl FrameKind {
    /// The kind of a wire byte.
    ///
    /// # Errors
    /// [`WireError::UnknownKind`] for a byte that names no kind.
    pub const fn from_u8(v: u8) -> Result<FrameKind, WireError> {
        Ok(match v {
            1 => FrameKind::Request,
            2 => FrameKind::Response,
            3 => FrameKind::StreamMessage,
            4 => FrameKind::EndOfStream,
            5 => FrameKind::Cancel,
            6 => FrameKind::CreditUpdate,
            7 => FrameKind::Status,
            8 => FrameKind::WindowUpdate,
            9 => FrameKind::BulkRelease,
            10 => FrameKind::GoAway,
            11 => FrameKind::BulkReady,
            _ => return Err(WireError::UnknownKind(v)),
        })
    }

    /// Data frames (Request, Response, StreamMessage, EndOfStream) may only use send credits
    /// above the reserve; the others are control frames and may use the reserve.
    pub const fn is_data(self) -> bool {
        matches!(
            self,
            FrameKind::Request
                | FrameKind::Response
                | FrameKind::StreamMessage
                | FrameKind::EndOfStream
        )
    }

    /// Whether the frame belongs to a call (`call_id != 0`) rather than to the connection.
    pub const fn is_call_scoped(self) -> bool {
        !matches!(self, FrameKind::CreditUpdate | FrameKind::GoAway)
    }

    /// The name used in error messages.
    pub const fn name(self) -> &'static str {
        match self {
            FrameKind::Request => "Request",
            FrameKind::Response => "Response",
            FrameKind::StreamMessage => "StreamMessage",
            FrameKind::EndOfStream => "EndOfStream",
            FrameKind::Cancel => "Cancel",
            FrameKind::CreditUpdate => "CreditUpdate",
            FrameKind::Status => "Status",
            FrameKind::WindowUpdate => "WindowUpdate",
            FrameKind::BulkRelease => "BulkRelease",
            FrameKind::GoAway => "GoAway",
            FrameKind::BulkReady => "BulkReady",
        }
    }
}

impl fmt::Display for FrameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The flag bits of a frame.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FrameFlags(u16);

impl FrameFlags {
    /// No flag.
    pub const EMPTY: FrameFlags = FrameFlags(0);
    /// A deadline extension follows the base header (Request only).
    pub const HAS_DEADLINE: FrameFlags = FrameFlags(1 << 0);
    /// A bulk descriptor follows: the payload is to be RDMA-READ from the sender (rendezvous);
    /// `payload_len` is 0 (Request, Response, StreamMessage).
    pub const HAS_BULK: FrameFlags = FrameFlags(1 << 1);
    /// A landing-zone descriptor follows: the server may RDMA-WRITE a large response there
    /// (Request only).
    pub const HAS_LANDING: FrameFlags = FrameFlags(1 << 2);
    /// On a Request: the client sends no stream (unary and server-streaming calls); the request
    /// half-closes the client's side.
    pub const END_STREAM: FrameFlags = FrameFlags(1 << 3);
    /// On a Response: the whole frame (header, metadata, payload) was RDMA-written into the
    /// landing zone the request advertised (WRITE_WITH_IMM, immediate = call id) instead of
    /// arriving in a receive slot.
    pub const WRITTEN: FrameFlags = FrameFlags(1 << 4);
    /// On a Request: the server answers with a stream (server-streaming and bidirectional).
    pub const SERVER_STREAM: FrameFlags = FrameFlags(1 << 5);
    /// On a Request with [`FrameFlags::HAS_BULK`]: a pieces extension follows the bulk
    /// descriptor; the payload is several remote ranges, READ one after the other into one
    /// buffer (a request whose large `bytes` field is sent from where it lies).
    pub const BULK_PIECES: FrameFlags = FrameFlags(1 << 6);
    /// Another frame follows this one in the same SEND (a batch; see the
    /// [module docs](self#batches-several-frames-in-one-send)). Any kind but a
    /// [`FrameFlags::WRITTEN`] Response.
    pub const MORE: FrameFlags = FrameFlags(1 << 7);
    /// On a CreditUpdate: from a server, "keep at most `aux` send credits and give the rest
    /// back" (it grants from a receive pool it shares among its connections); from a client,
    /// the answer: `aux` credits given back (possibly 0). See
    /// [`Conn::reclaim`](super::Conn::reclaim).
    pub const RECLAIM: FrameFlags = FrameFlags(1 << 8);
    /// The sender ran out of credits for a data frame since its last frame (frames of its
    /// wait for credits): a receiver that grants from a shared pool grows its window. Any
    /// kind. See [`Conn::take_peer_starved`](super::Conn::take_peer_starved).
    pub const STARVED: FrameFlags = FrameFlags(1 << 9);
    /// On a StreamMessage without a bulk descriptor: the payload is `aux` messages of the
    /// stream, each a `u32` length and its bytes (see the
    /// [module docs](self#packed-stream-messages)).
    pub const PACKED: FrameFlags = FrameFlags(1 << 10);
    /// On a Request with [`FrameFlags::HAS_BULK`] and one range: the range's bytes are still
    /// being written; READ only what BulkReady frames say is ready (see the
    /// [module docs](self#payloads-that-become-ready-while-they-are-read)).
    pub const BULK_PENDING: FrameFlags = FrameFlags(1 << 11);
    /// Every flag this version knows.
    pub const KNOWN: FrameFlags = FrameFlags(0xfff);
    /// The flags that announce an extension.
    pub const EXTENSIONS: FrameFlags = FrameFlags(0x47);

    /// The flags of `bits`, or `None` if some bit is unknown.
    pub const fn from_bits(bits: u16) -> Option<FrameFlags> {
        if bits & !Self::KNOWN.0 == 0 {
            Some(FrameFlags(bits))
        } else {
            None
        }
    }

    /// The raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }

    /// Whether every bit of `other` is set.
    pub const fn contains(self, other: FrameFlags) -> bool {
        self.0 & other.0 == other.0
    }

    /// Whether any bit of `other` is set.
    pub const fn intersects(self, other: FrameFlags) -> bool {
        self.0 & other.0 != 0
    }

    /// `self` with the bits of `other` set when `on`, cleared otherwise.
    #[must_use]
    pub const fn with(self, other: FrameFlags, on: bool) -> FrameFlags {
        if on {
            FrameFlags(self.0 | other.0)
        } else {
            FrameFlags(self.0 & !other.0)
        }
    }
}

impl std::ops::BitOr for FrameFlags {
    type Output = FrameFlags;
    fn bitor(self, rhs: FrameFlags) -> FrameFlags {
        FrameFlags(self.0 | rhs.0)
    }
}

impl std::ops::BitOrAssign for FrameFlags {
    fn bitor_assign(&mut self, rhs: FrameFlags) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for FrameFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [(FrameFlags, &str); 12] = [
            (FrameFlags::HAS_DEADLINE, "HAS_DEADLINE"),
            (FrameFlags::HAS_BULK, "HAS_BULK"),
            (FrameFlags::HAS_LANDING, "HAS_LANDING"),
            (FrameFlags::END_STREAM, "END_STREAM"),
            (FrameFlags::WRITTEN, "WRITTEN"),
            (FrameFlags::SERVER_STREAM, "SERVER_STREAM"),
            (FrameFlags::BULK_PIECES, "BULK_PIECES"),
            (FrameFlags::MORE, "MORE"),
            (FrameFlags::RECLAIM, "RECLAIM"),
            (FrameFlags::STARVED, "STARVED"),
            (FrameFlags::PACKED, "PACKED"),
            (FrameFlags::BULK_PENDING, "BULK_PENDING"),
        ];
        if self.0 == 0 {
            return f.write_str("(empty)");
        }
        let mut first = true;
        for (flag, name) in NAMES {
            if self.contains(flag) {
                if !first {
                    f.write_str(" | ")?;
                }
                f.write_str(name)?;
                first = false;
            }
        }
        let unknown = self.0 & !Self::KNOWN.0;
        if unknown != 0 {
            if !first {
                f.write_str(" | ")?;
            }
            write!(f, "{unknown:#06x}")?;
        }
        Ok(())
    }
}

/// A region of registered memory a peer may reach with one-sided operations: the bulk payload
/// to READ, or the landing zone to WRITE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct BulkDesc {
    /// Address in the advertiser's address space.
    pub addr: u64,
    /// Length in bytes (never 0 on the wire).
    pub len: u64,
    /// Remote key of the region.
    pub rkey: u32,
}

/// The ranges of a rendezvous Request payload after the first ([`FrameHeader::bulk`]): the
/// payload is the first range followed by these, in order. Empty on every other frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct BulkMore {
    n: u8,
    ranges: [BulkDesc; MAX_BULK_PIECES - 1],
}

impl BulkMore {
    /// No further range.
    pub const NONE: BulkMore = BulkMore {
        n: 0,
        ranges: [BulkDesc {
            addr: 0,
            len: 0,
            rkey: 0,
        }; MAX_BULK_PIECES - 1],
    };

    /// The ranges of `more`, or `None` when there are more than `MAX_BULK_PIECES - 1`.
    pub fn from_slice(more: &[BulkDesc]) -> Option<BulkMore> {
        let mut m = BulkMore::NONE;
        m.ranges.get_mut(..more.len())?.copy_from_slice(more);
        m.n = more.len() as u8;
        Some(m)
    }

    /// The ranges, in order.
    pub fn as_slice(&self) -> &[BulkDesc] {
        &self.ranges[..usize::from(self.n)]
    }

    /// How many ranges.
    pub const fn len(&self) -> usize {
        self.n as usize
    }

    /// Whether there is none.
    pub const fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Their total length, `None` on overflow.
    pub fn total_len(&self) -> Option<u64> {
        self.as_slice()
            .iter()
            .try_fold(0u64, |a, d| a.checked_add(d.len))
    }
}

/// A frame header: the base header plus its extensions. The flags that announce extensions
/// ([`FrameFlags::EXTENSIONS`]) must agree with the `Option` fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FrameHeader {
    /// What the frame is.
    pub kind: FrameKind,
    /// Flags, extension flags included.
    pub flags: FrameFlags,
    /// The call (0 for CreditUpdate and GoAway).
    pub call_id: u32,
    /// Method id (Request), status code (Status), grant (WindowUpdate), low half of the
    /// bytes ready (BulkReady), 0 otherwise.
    pub aux: u32,
    /// Receive slots the sender re-posted for the receiver since its last report.
    pub credits: u16,
    /// Metadata bytes after the extensions.
    pub metadata_len: u16,
    /// Inline payload bytes after the metadata.
    pub payload_len: u32,
    /// Stream message sequence number (StreamMessage, EndOfStream), high half of the bytes
    /// ready (BulkReady); 0 otherwise.
    pub seq: u32,
    /// Time left for the call in nanoseconds (Request only).
    pub deadline: Option<u64>,
    /// Payload to RDMA-READ from the sender (its first range, when `bulk_more` has more).
    pub bulk: Option<BulkDesc>,
    /// Further ranges of a rendezvous Request payload ([`FrameFlags::BULK_PIECES`]).
    pub bulk_more: BulkMore,
    /// Where the server may RDMA-WRITE the response (Request only).
    pub landing: Option<BulkDesc>,
}

/// A decoded frame, borrowing its metadata and payload from the receive buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The header.
    pub header: FrameHeader,
    /// Metadata bytes (encoded [`crate::Metadata`]).
    pub metadata: &'a [u8],
    /// Inline payload bytes.
    pub payload: &'a [u8],
}

/// The flags a plain call frame may carry (see [`FrameHeader::check`]'s shortcut).
const PLAIN_FLAGS: FrameFlags = FrameFlags(
    FrameFlags::MORE.0
        | FrameFlags::STARVED.0
        | FrameFlags::HAS_DEADLINE.0
        | FrameFlags::END_STREAM.0
        | FrameFlags::SERVER_STREAM.0,
);

impl FrameHeader {
    /// A header of `kind` for `call_id` with every other field zero and no extension.
    pub const fn new(kind: FrameKind, call_id: u32) -> FrameHeader {
        FrameHeader {
            kind,
            flags: FrameFlags::EMPTY,
            call_id,
            aux: 0,
            credits: 0,
            metadata_len: 0,
            payload_len: 0,
            seq: 0,
            deadline: None,
            bulk: None,
            bulk_more: BulkMore::NONE,
            landing: None,
        }
    }

    /// Bytes of the rendezvous payload: the bulk range plus the further ones (saturating; a
    /// valid header does not overflow), 0 without bulk.
    pub fn bulk_len(&self) -> u64 {
        let first = self.bulk.map_or(0, |b| b.len);
        first.saturating_add(self.bulk_more.total_len().unwrap_or(u64::MAX))
    }

    /// Bytes of the header on the wire: 24 plus its extensions.
    pub const fn encoded_len(&self) -> usize {
        let mut n = BASE_HEADER_LEN;
        if self.deadline.is_some() {
            n += DEADLINE_EXT_LEN;
        }
        if self.bulk.is_some() {
            n += BULK_EXT_LEN;
        }
        if !self.bulk_more.is_empty() {
            n += PIECES_EXT_BASE + self.bulk_more.len() * BULK_EXT_LEN;
        }
        if self.landing.is_some() {
            n += BULK_EXT_LEN;
        }
        n
    }

    /// Bytes of the whole frame: header, extensions, metadata and inline payload.
    pub const fn frame_len(&self) -> u64 {
        self.encoded_len() as u64 + self.metadata_len as u64 + self.payload_len as u64
    }

    /// Writes the header and its extensions at the start of `out` and returns the number of
    /// bytes written ([`FrameHeader::encoded_len`]); the caller writes metadata and payload
    /// after them.
    ///
    /// # Errors
    /// [`WireError::BufferTooSmall`] when `out` is shorter than the header;
    /// [`WireError::Inconsistent`] (and the other validation errors of [`decode`]) when the
    /// header breaks a rule of the protocol, so that a peer would refuse it.
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, WireError> {
        self.check()?;
        let len = self.encoded_len();
        let Some(out) = out.get_mut(..len) else {
            return Err(WireError::BufferTooSmall {
                need: len,
                have: out.len(),
            });
        };
        let mut w = Writer { buf: out, pos: 0 };
        w.put(&[WIRE_VERSION, self.kind as u8]);
        w.put(&self.flags.bits().to_le_bytes());
        w.put(&self.call_id.to_le_bytes());
        w.put(&self.aux.to_le_bytes());
        w.put(&self.credits.to_le_bytes());
        w.put(&self.metadata_len.to_le_bytes());
        w.put(&self.payload_len.to_le_bytes());
        w.put(&self.seq.to_le_bytes());
        if let Some(t) = self.deadline {
            w.put(&t.to_le_bytes());
        }
        let put_desc = |w: &mut Writer<'_>, d: BulkDesc| {
            w.put(&d.addr.to_le_bytes());
            w.put(&d.len.to_le_bytes());
            w.put(&d.rkey.to_le_bytes());
            w.put(&0u32.to_le_bytes());
        };
        if let Some(d) = self.bulk {
            put_desc(&mut w, d);
        }
        if !self.bulk_more.is_empty() {
            w.put(&(self.bulk_more.len() as u32).to_le_bytes());
            w.put(&0u32.to_le_bytes());
            for &d in self.bulk_more.as_slice() {
                put_desc(&mut w, d);
            }
        }
        if let Some(d) = self.landing {
            put_desc(&mut w, d);
        }
        debug_assert_eq!(w.pos, len);
        Ok(len)
    }

    /// Checks the rules that tie flags, kind and fields together (see [`decode`]).
    ///
    /// # Errors
    /// [`WireError::UnknownFlags`] or [`WireError::Inconsistent`] naming the broken rule.
    #[inline]
    pub fn check(&self) -> Result<(), WireError> {
        if self.is_plain_and_sound() {
            return Ok(());
        }
        self.check_all()
    }

    /// Whether this is a plain call frame (a Request, Response, StreamMessage or Status with
    /// no bulk range, landing zone, packing or WRITTEN) that keeps every rule: the frames of
    /// small calls and streams, checked at every encode and decode. A few comparisons instead
    /// of [`FrameHeader::check_all`]'s walk through every rule (about 95 instructions, twice
    /// per call on each side). `false` only means "not shown here": `check_all` decides.
    #[inline]
    fn is_plain_and_sound(&self) -> bool {
        const PLAIN: u16 = PLAIN_FLAGS.bits();
        const REQUEST_ONLY: u16 = FrameFlags::HAS_DEADLINE.bits()
            | FrameFlags::END_STREAM.bits()
            | FrameFlags::SERVER_STREAM.bits();
        let f = self.flags.bits();
        if f & !PLAIN != 0
            || self.bulk.is_some()
            || self.landing.is_some()
            || !self.bulk_more.is_empty()
            || (f & FrameFlags::HAS_DEADLINE.bits() != 0) != self.deadline.is_some()
            || self.call_id == 0
        {
            return false;
        }
        match self.kind {
            FrameKind::Request => {
                self.aux != 0
                    && self.seq == 0
                    && (f & FrameFlags::END_STREAM.bits() != 0 || self.payload_len == 0)
            }
            FrameKind::Response => f & REQUEST_ONLY == 0 && self.aux == 0 && self.seq == 0,
            FrameKind::StreamMessage => f & REQUEST_ONLY == 0 && self.aux == 0,
            FrameKind::Status => {
                f & REQUEST_ONLY == 0 && self.aux <= u32::from(u8::MAX) && self.seq == 0
            }
            _ => false,
        }
    }

    /// Every rule of [`FrameHeader::check`], one by one.
    fn check_all(&self) -> Result<(), WireError> {
        use FrameKind as K;
        let f = self.flags;
        let k = self.kind;
        if FrameFlags::from_bits(f.bits()).is_none() {
            return Err(WireError::UnknownFlags(
                f.bits() & !FrameFlags::KNOWN.bits(),
            ));
        }
        if f.contains(FrameFlags::HAS_DEADLINE) != self.deadline.is_some() {
            return Err(WireError::Inconsistent(
                "HAS_DEADLINE flag and deadline extension disagree",
            ));
        }
        if f.contains(FrameFlags::HAS_BULK) != self.bulk.is_some() {
            return Err(WireError::Inconsistent(
                "HAS_BULK flag and bulk descriptor disagree",
            ));
        }
        if f.contains(FrameFlags::HAS_LANDING) != self.landing.is_some() {
            return Err(WireError::Inconsistent(
                "HAS_LANDING flag and landing descriptor disagree",
            ));
        }
        let request_only = FrameFlags::HAS_DEADLINE
            | FrameFlags::HAS_LANDING
            | FrameFlags::END_STREAM
            | FrameFlags::SERVER_STREAM;
        if k != K::Request && f.intersects(request_only) {
            return Err(WireError::Inconsistent(
                "HAS_DEADLINE, HAS_LANDING, END_STREAM and SERVER_STREAM are for Request frames only",
            ));
        }
        if let Some(b) = self.bulk {
            if !matches!(k, K::Request | K::Response | K::StreamMessage) {
                return Err(WireError::Inconsistent(
                    "HAS_BULK on a frame that carries no message",
                ));
            }
            if self.payload_len != 0 {
                return Err(WireError::Inconsistent(
                    "HAS_BULK with inline payload (payload_len must be 0)",
                ));
            }
            if b.len == 0 {
                return Err(WireError::Inconsistent("bulk descriptor of length 0"));
            }
        }
        if f.contains(FrameFlags::BULK_PIECES) == self.bulk_more.is_empty() {
            return Err(WireError::Inconsistent(
                "BULK_PIECES flag and pieces extension disagree",
            ));
        }
        if !self.bulk_more.is_empty() {
            if k != K::Request {
                return Err(WireError::Inconsistent(
                    "BULK_PIECES on a frame other than Request",
                ));
            }
            if self.bulk.is_none() {
                return Err(WireError::Inconsistent("BULK_PIECES without HAS_BULK"));
            }
            if self.bulk_more.as_slice().iter().any(|d| d.len == 0) {
                return Err(WireError::Inconsistent("bulk piece of length 0"));
            }
            let first = self.bulk.map_or(0, |b| b.len);
            if self
                .bulk_more
                .total_len()
                .and_then(|t| t.checked_add(first))
                .is_none()
            {
                return Err(WireError::Inconsistent(
                    "bulk pieces longer than 2^64 bytes in total",
                ));
            }
        }
        if f.contains(FrameFlags::BULK_PENDING)
            && (k != K::Request || self.bulk.is_none() || !self.bulk_more.is_empty())
        {
            return Err(WireError::Inconsistent(
                "BULK_PENDING on a frame other than a Request with one bulk range",
            ));
        }
        if self.landing.is_some_and(|l| l.len == 0) {
            return Err(WireError::Inconsistent("landing descriptor of length 0"));
        }
        if f.contains(FrameFlags::WRITTEN) {
            if k != K::Response {
                return Err(WireError::Inconsistent(
                    "WRITTEN on a frame other than Response",
                ));
            }
            if self.bulk.is_some() {
                return Err(WireError::Inconsistent("WRITTEN together with HAS_BULK"));
            }
            if f.contains(FrameFlags::MORE) {
                return Err(WireError::Inconsistent(
                    "WRITTEN together with MORE (a landing zone holds one frame)",
                ));
            }
        }
        if f.contains(FrameFlags::RECLAIM) && k != K::CreditUpdate {
            return Err(WireError::Inconsistent(
                "RECLAIM on a frame other than CreditUpdate",
            ));
        }
        if f.contains(FrameFlags::PACKED) {
            if k != K::StreamMessage {
                return Err(WireError::Inconsistent(
                    "PACKED on a frame other than StreamMessage",
                ));
            }
            if self.bulk.is_some() {
                return Err(WireError::Inconsistent("PACKED together with HAS_BULK"));
            }
            if self.aux == 0 {
                return Err(WireError::Inconsistent("PACKED with no message (aux 0)"));
            }
            if u64::from(self.aux) * super::packed::PREFIX_LEN as u64 > u64::from(self.payload_len)
            {
                return Err(WireError::Inconsistent(
                    "PACKED with more messages than its payload has lengths for",
                ));
            }
        }
        if k.is_call_scoped() == (self.call_id == 0) {
            return Err(WireError::Inconsistent(if self.call_id == 0 {
                "call id 0 on a frame that belongs to a call"
            } else {
                "nonzero call id on a connection frame (CreditUpdate, GoAway)"
            }));
        }
        match k {
            K::Request if self.aux == 0 => {
                return Err(WireError::Inconsistent(
                    "Request for method id 0 (reserved)",
                ));
            }
            K::Status if self.aux > u32::from(u8::MAX) => {
                return Err(WireError::Inconsistent("Status code above 255"));
            }
            K::WindowUpdate if self.aux == 0 => {
                return Err(WireError::Inconsistent("WindowUpdate granting nothing"));
            }
            K::BulkReady if self.aux == 0 && self.seq == 0 => {
                return Err(WireError::Inconsistent("BulkReady with no byte ready"));
            }
            K::Request | K::Status | K::WindowUpdate | K::BulkReady => {}
            K::CreditUpdate if f.contains(FrameFlags::RECLAIM) => {}
            K::StreamMessage if f.contains(FrameFlags::PACKED) => {}
            _ if self.aux != 0 => {
                return Err(WireError::Inconsistent(
                    "nonzero aux on a frame kind that does not use it",
                ));
            }
            _ => {}
        }
        if !matches!(k, K::StreamMessage | K::EndOfStream | K::BulkReady) && self.seq != 0 {
            return Err(WireError::Inconsistent(
                "nonzero seq on a frame other than StreamMessage/EndOfStream/BulkReady",
            ));
        }
        if matches!(
            k,
            K::EndOfStream
                | K::Cancel
                | K::CreditUpdate
                | K::WindowUpdate
                | K::BulkRelease
                | K::GoAway
                | K::BulkReady
        ) && (self.metadata_len != 0 || self.payload_len != 0)
        {
            return Err(WireError::Inconsistent(
                "metadata or payload on a frame kind that carries none",
            ));
        }
        if k == K::Request
            && !f.contains(FrameFlags::END_STREAM)
            && (self.payload_len != 0 || self.bulk.is_some())
        {
            return Err(WireError::Inconsistent(
                "payload on the Request of a client-streaming call (messages go as StreamMessage)",
            ));
        }
        Ok(())
    }
}

/// Decodes the frame at the start of `buf`. `buf` may be longer than the frame (receive slots
/// have a fixed size): the frame's length is what its header says.
///
/// Checks the version, the kind, that only known flags are set, that flags agree with the kind
/// and the fields (extensions only where they belong, bulk only with `payload_len == 0`, call
/// id 0 exactly on connection frames, `aux` and `seq` only where used, reserved padding zero,
/// no message on control frames), that header, metadata and payload lie inside `buf`, and that
/// a packed payload is exactly its messages ([`super::packed::check`]). Never panics, whatever
/// `buf` holds.
///
/// # Errors
/// The first rule the bytes break, as a [`WireError`].
#[inline]
pub fn decode(buf: &[u8]) -> Result<Frame<'_>, WireError> {
    let mut r = Reader { buf, pos: 0 };
    let header = read_header(&mut r)?;
    let metadata = r.bytes(usize::from(header.metadata_len))?;
    let payload_len = usize::try_from(header.payload_len).unwrap_or(usize::MAX);
    let payload = r.bytes(payload_len)?;
    if header.flags.contains(FrameFlags::PACKED) {
        super::packed::check(payload, header.aux)?;
    }
    Ok(Frame {
        header,
        metadata,
        payload,
    })
}

// Inlined: a header is 160 bytes in memory, and returned through a `Result` it was copied with
// `memcpy` at every frame (the largest `memcpy` caller of a pipelining client and shard).
#[inline(always)]
fn read_header(r: &mut Reader<'_>) -> Result<FrameHeader, WireError> {
    let [version, kind] = r.array::<2>()?;
    if version != WIRE_VERSION {
        return Err(WireError::BadVersion(version));
    }
    let kind = FrameKind::from_u8(kind)?;
    let bits = u16::from_le_bytes(r.array()?);
    let flags = FrameFlags::from_bits(bits)
        .ok_or(WireError::UnknownFlags(bits & !FrameFlags::KNOWN.bits()))?;
    let call_id = u32::from_le_bytes(r.array()?);
    let aux = u32::from_le_bytes(r.array()?);
    let credits = u16::from_le_bytes(r.array()?);
    let metadata_len = u16::from_le_bytes(r.array()?);
    let payload_len = u32::from_le_bytes(r.array()?);
    let seq = u32::from_le_bytes(r.array()?);
    let deadline = if flags.contains(FrameFlags::HAS_DEADLINE) {
        Some(u64::from_le_bytes(r.array()?))
    } else {
        None
    };
    let bulk = if flags.contains(FrameFlags::HAS_BULK) {
        Some(r.bulk()?)
    } else {
        None
    };
    let bulk_more = if flags.contains(FrameFlags::BULK_PIECES) {
        r.pieces()?
    } else {
        BulkMore::NONE
    };
    let landing = if flags.contains(FrameFlags::HAS_LANDING) {
        Some(r.bulk()?)
    } else {
        None
    };
    let header = FrameHeader {
        kind,
        flags,
        call_id,
        aux,
        credits,
        metadata_len,
        payload_len,
        seq,
        deadline,
        bulk,
        bulk_more,
        landing,
    };
    header.check()?;
    Ok(header)
}

/// Where the frame after `frame` starts in the bytes of one SEND: `buf` is everything the
/// SEND delivered (exactly its byte length) and `frame` was decoded at offset `at` of it.
/// `Ok(None)` when `frame` is the last one.
///
/// # Errors
/// [`WireError::BatchTruncated`] when `frame` has [`FrameFlags::MORE`] but the SEND ends with
/// it; [`WireError::BatchTrailing`] when it has not but bytes follow it.
pub fn next_in_batch(buf: &[u8], at: usize, frame: &Frame<'_>) -> Result<Option<usize>, WireError> {
    // `decode` checked that the frame lies inside `buf[at..]`, so this neither overflows nor
    // passes `buf.len()`; saturating all the same, never trusting it.
    let end = usize::try_from(frame.header.frame_len())
        .unwrap_or(usize::MAX)
        .saturating_add(at);
    let more = frame.header.flags.contains(FrameFlags::MORE);
    match (more, end < buf.len()) {
        (true, true) => Ok(Some(end)),
        (false, false) => Ok(None),
        (true, false) => Err(WireError::BatchTruncated { at: end }),
        (false, true) => Err(WireError::BatchTrailing {
            end,
            len: buf.len(),
        }),
    }
}

/// The frames of one SEND, in order (see [`next_in_batch`]); stops after the first error.
/// The runtime walks a batch frame by frame with [`decode`] and [`next_in_batch`] itself (each
/// frame is handled before the next is read); this is the same walk, for tests and fuzzing.
#[derive(Clone, Debug)]
pub struct Batch<'a> {
    buf: &'a [u8],
    at: Option<usize>,
}

impl<'a> Batch<'a> {
    /// The frames of `buf`, the bytes one SEND delivered.
    pub fn new(buf: &'a [u8]) -> Batch<'a> {
        Batch { buf, at: Some(0) }
    }
}

impl<'a> Iterator for Batch<'a> {
    /// A frame and its offset in the SEND.
    type Item = Result<(usize, Frame<'a>), WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        let at = self.at.take()?;
        let rest = self.buf.get(at..).unwrap_or_default();
        let frame = match decode(rest) {
            Ok(f) => f,
            Err(e) => return Some(Err(e)),
        };
        match next_in_batch(self.buf, at, &frame) {
            Ok(next) => {
                self.at = next;
                Some(Ok((at, frame)))
            }
            Err(e) => Some(Err(e)),
        }
    }
}

/// Sets [`FrameFlags::MORE`] in an encoded header (`header` starts at its first byte): a
/// sender that appends a frame to a SEND marks the frame before it.
///
/// Only the fixed part the flag depends on is read (version, kind, flags): the header was
/// checked whole when it was encoded, and the receiver checks every frame of the batch.
/// Decoding and checking the whole header again here was a few percent of a pipelining
/// shard's time (it runs for every frame that another one joins).
///
/// # Errors
/// [`WireError::Truncated`] for less than a base header, [`WireError::BadVersion`],
/// [`WireError::UnknownKind`] or [`WireError::UnknownFlags`] for bytes that are not a frame
/// header this version sends, and [`WireError::Inconsistent`] on a [`FrameFlags::WRITTEN`]
/// Response (a landing zone holds one frame). Nothing is written then.
pub fn mark_more(header: &mut [u8]) -> Result<(), WireError> {
    let Some(&[version, kind, lo, hi]) = header
        .get(..BASE_HEADER_LEN)
        .and_then(|h| h.first_chunk::<4>())
    else {
        return Err(WireError::Truncated {
            need: BASE_HEADER_LEN,
            have: header.len(),
        });
    };
    if version != WIRE_VERSION {
        return Err(WireError::BadVersion(version));
    }
    FrameKind::from_u8(kind)?;
    let bits = u16::from_le_bytes([lo, hi]);
    let flags = FrameFlags::from_bits(bits)
        .ok_or(WireError::UnknownFlags(bits & !FrameFlags::KNOWN.bits()))?;
    if flags.contains(FrameFlags::WRITTEN) {
        return Err(WireError::Inconsistent(
            "WRITTEN together with MORE (a landing zone holds one frame)",
        ));
    }
    let marked = (flags | FrameFlags::MORE).bits().to_le_bytes();
    if let Some(b) = header.get_mut(2..4) {
        b.copy_from_slice(&marked);
    }
    Ok(())
}

/// Reads fixed-size pieces off a byte slice, reporting how many bytes were missing.
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn truncated(&self, n: usize) -> WireError {
        WireError::Truncated {
            need: self.pos.saturating_add(n),
            have: self.buf.len(),
        }
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        let chunk = self
            .buf
            .get(self.pos..)
            .and_then(|rest| rest.first_chunk::<N>())
            .ok_or_else(|| self.truncated(N))?;
        self.pos += N;
        Ok(*chunk)
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        let end = self.pos.checked_add(n).ok_or_else(|| self.truncated(n))?;
        let s = self
            .buf
            .get(self.pos..end)
            .ok_or_else(|| self.truncated(n))?;
        self.pos = end;
        Ok(s)
    }

    fn bulk(&mut self) -> Result<BulkDesc, WireError> {
        let addr = u64::from_le_bytes(self.array()?);
        let len = u64::from_le_bytes(self.array()?);
        let rkey = u32::from_le_bytes(self.array()?);
        let pad = u32::from_le_bytes(self.array()?);
        if pad != 0 {
            return Err(WireError::Inconsistent(
                "nonzero padding in a bulk/landing descriptor",
            ));
        }
        Ok(BulkDesc { addr, len, rkey })
    }

    fn pieces(&mut self) -> Result<BulkMore, WireError> {
        let count = u32::from_le_bytes(self.array()?);
        let pad = u32::from_le_bytes(self.array()?);
        if count == 0 || count as usize > MAX_BULK_PIECES - 1 {
            return Err(WireError::Inconsistent(
                "bulk piece count out of range (1 to MAX_BULK_PIECES - 1 further pieces)",
            ));
        }
        if pad != 0 {
            return Err(WireError::Inconsistent(
                "nonzero padding in a pieces extension",
            ));
        }
        let mut more = BulkMore::NONE;
        for d in more.ranges.iter_mut().take(count as usize) {
            *d = self.bulk()?;
        }
        more.n = count as u8;
        Ok(more)
    }
}

/// Writes into a slice already checked to be long enough.
struct Writer<'a> {
    buf: &'a mut [u8],
    pos: usize,
}

impl Writer<'_> {
    fn put(&mut self, bytes: &[u8]) {
        let end = self.pos + bytes.len();
        if let Some(dst) = self.buf.get_mut(self.pos..end) {
            dst.copy_from_slice(bytes);
        }
        self.pos = end;
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    fn request() -> FrameHeader {
        FrameHeader {
            flags: FrameFlags::HAS_DEADLINE
                | FrameFlags::HAS_LANDING
                | FrameFlags::END_STREAM
                | FrameFlags::SERVER_STREAM,
            aux: 0xdead_beef,
            credits: 7,
            metadata_len: 3,
            payload_len: 5,
            deadline: Some(1_000_000),
            landing: Some(BulkDesc {
                addr: 0x1000,
                len: 1 << 20,
                rkey: 42,
            }),
            ..FrameHeader::new(FrameKind::Request, 0x0001_0002)
        }
    }

    fn encode_frame(h: &FrameHeader, md: &[u8], payload: &[u8]) -> Vec<u8> {
        let mut buf = vec![0u8; h.encoded_len() + md.len() + payload.len()];
        let n = h.encode(&mut buf).unwrap();
        buf[n..n + md.len()].copy_from_slice(md);
        buf[n + md.len()..].copy_from_slice(payload);
        buf
    }

    #[test]
    fn layout_is_little_endian_at_fixed_offsets() {
        let h = FrameHeader {
            flags: FrameFlags::END_STREAM,
            aux: 0x0403_0201,
            credits: 0x0605,
            metadata_len: 0x0807,
            payload_len: 0,
            ..FrameHeader::new(FrameKind::Request, 0x0d0c_0b0a)
        };
        let mut buf = [0xffu8; 40];
        assert_eq!(h.encode(&mut buf).unwrap(), 24);
        assert_eq!(
            &buf[..24],
            &[
                5, 1, 0x08, 0x00, 0x0a, 0x0b, 0x0c, 0x0d, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07,
                0x08, 0, 0, 0, 0, 0, 0, 0, 0
            ]
        );
        assert_eq!(buf[24], 0xff, "encode writes only the header");
    }

    #[test]
    fn round_trip_with_every_extension() {
        let h = request();
        assert_eq!(h.encoded_len(), BASE_HEADER_LEN + 8 + 24);
        let buf = encode_frame(&h, b"abc", b"hello");
        let mut long = buf.clone();
        long.extend_from_slice(&[0xee; 100]); // slots are longer than frames
        let f = decode(&long).unwrap();
        assert_eq!(f.header, h);
        assert_eq!(f.metadata, b"abc");
        assert_eq!(f.payload, b"hello");
        assert_eq!(f.header.frame_len(), buf.len() as u64);

        let bulk = FrameHeader {
            flags: FrameFlags::HAS_BULK,
            bulk: Some(BulkDesc {
                addr: u64::MAX,
                len: 5 << 30,
                rkey: u32::MAX,
            }),
            ..FrameHeader::new(FrameKind::Response, 9)
        };
        let buf = encode_frame(&bulk, &[], &[]);
        let f = decode(&buf).unwrap();
        assert_eq!(f.header, bulk);
        assert_eq!(bulk.encoded_len(), BASE_HEADER_LEN + BULK_EXT_LEN);
    }

    #[test]
    fn encode_refuses_short_buffer_and_bad_headers() {
        let h = request();
        let mut small = [0u8; 40];
        assert_eq!(
            h.encode(&mut small),
            Err(WireError::BufferTooSmall { need: 56, have: 40 })
        );
        let mut buf = [0u8; MAX_HEADER_LEN];
        let mut bad = h;
        bad.deadline = None;
        assert!(matches!(
            bad.encode(&mut buf),
            Err(WireError::Inconsistent(_))
        ));
        let bad = FrameHeader::new(FrameKind::CreditUpdate, 3);
        assert!(matches!(
            bad.encode(&mut buf),
            Err(WireError::Inconsistent(_))
        ));
    }

    /// A frame shorter than the base header is read field by field, in wire order: a bad
    /// version or kind shows before the truncation, and the truncation names the end of the
    /// field it cut.
    #[test]
    fn a_short_header_names_its_first_fault() {
        let good = encode_frame(&request(), b"abc", b"hello");
        // Ends of the base header's fields: version and kind, flags, call id, aux, credits,
        // metadata length, payload length, seq.
        let ends = [2, 4, 8, 12, 14, 16, 20, 24];
        for cut in 0..BASE_HEADER_LEN {
            let need = *ends.iter().find(|&&e| e > cut).unwrap();
            assert_eq!(
                decode(&good[..cut]),
                Err(WireError::Truncated { need, have: cut }),
                "cut at {cut}"
            );
            if cut >= 2 {
                let mut bad = good.clone();
                bad[0] = WIRE_VERSION.wrapping_add(1);
                assert_eq!(
                    decode(&bad[..cut]),
                    Err(WireError::BadVersion(bad[0])),
                    "cut at {cut}"
                );
            }
            if cut >= 4 {
                let mut bad = good.clone();
                bad[2..4].copy_from_slice(&0x8000u16.to_le_bytes());
                assert!(
                    matches!(decode(&bad[..cut]), Err(WireError::UnknownFlags(_))),
                    "cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn decode_names_what_is_wrong() {
        let good = encode_frame(&request(), b"abc", b"hello");
        assert_eq!(
            decode(&good[..10]),
            Err(WireError::Truncated { need: 12, have: 10 })
        );
        assert_eq!(
            decode(&good[..30]),
            Err(WireError::Truncated { need: 32, have: 30 })
        );
        // Header fine, payload cut.
        let cut = good.len() - 2;
        assert_eq!(
            decode(&good[..cut]),
            Err(WireError::Truncated {
                need: good.len(),
                have: cut
            })
        );
        let mut b = good.clone();
        b[0] = 1;
        assert_eq!(
            decode(&b),
            Err(WireError::BadVersion(1)),
            "a version-1 peer is refused"
        );
        b[0] = 2;
        assert_eq!(
            decode(&b),
            Err(WireError::BadVersion(2)),
            "a version-2 peer (no credit reclaims) is refused"
        );
        b[0] = 3;
        assert_eq!(
            decode(&b),
            Err(WireError::BadVersion(3)),
            "a version-3 peer (no packed stream messages) is refused"
        );
        b[0] = 4;
        assert_eq!(
            decode(&b),
            Err(WireError::BadVersion(4)),
            "a version-4 peer (no pending payloads) is refused"
        );
        b[0] = 6;
        assert_eq!(decode(&b), Err(WireError::BadVersion(6)));
        let mut b = good.clone();
        b[1] = 0;
        assert_eq!(decode(&b), Err(WireError::UnknownKind(0)));
        b[1] = 12;
        assert_eq!(decode(&b), Err(WireError::UnknownKind(12)));
        let mut b = good.clone();
        b[3] = 0x80;
        assert_eq!(decode(&b), Err(WireError::UnknownFlags(0x8000)));
        // Landing on a Response.
        let mut b = good.clone();
        b[1] = FrameKind::Response as u8;
        assert!(matches!(decode(&b), Err(WireError::Inconsistent(_))));
        // Non-zero descriptor padding.
        let mut b = good.clone();
        b[24 + 8 + 20] = 1;
        assert!(matches!(decode(&b), Err(WireError::Inconsistent(m)) if m.contains("padding")));
        // An error message says what is wrong.
        let msg = WireError::Truncated { need: 12, have: 10 }.to_string();
        assert!(msg.contains("12") && msg.contains("10"), "{msg}");
    }

    #[test]
    fn pending_payloads_and_bulk_ready() {
        use FrameKind as K;
        let encodes = |h: FrameHeader| {
            let mut buf = [0u8; MAX_HEADER_LEN];
            h.encode(&mut buf)
                .map(|n| decode(&buf[..n]).map(|f| f.header))
        };
        let bulk = Some(BulkDesc {
            addr: 64,
            len: 5 << 30,
            rkey: 9,
        });
        let pending = FrameHeader {
            aux: 3,
            flags: FrameFlags::HAS_BULK | FrameFlags::END_STREAM | FrameFlags::BULK_PENDING,
            bulk,
            ..FrameHeader::new(K::Request, 7)
        };
        assert_eq!(encodes(pending), Ok(Ok(pending)));
        // Ready counts above 4 GiB use both halves.
        let ready = FrameHeader {
            aux: 1 << 20,
            seq: 1,
            ..FrameHeader::new(K::BulkReady, 7)
        };
        assert_eq!(encodes(ready), Ok(Ok(ready)));
        let refused = |h: FrameHeader, why: &str| match encodes(h) {
            Err(WireError::Inconsistent(m)) => assert!(m.contains(why), "{m}"),
            other => panic!("{h:?} was not refused: {other:?}"),
        };
        // Nothing ready, a payload, call id 0.
        refused(FrameHeader::new(K::BulkReady, 7), "no byte ready");
        refused(
            FrameHeader {
                payload_len: 1,
                ..ready
            },
            "carries none",
        );
        refused(
            FrameHeader {
                call_id: 0,
                ..ready
            },
            "call id 0",
        );
        // BULK_PENDING without bulk, on a Response, with several ranges.
        refused(
            FrameHeader {
                flags: FrameFlags::END_STREAM | FrameFlags::BULK_PENDING,
                bulk: None,
                ..pending
            },
            "BULK_PENDING",
        );
        refused(
            FrameHeader {
                aux: 0,
                flags: FrameFlags::HAS_BULK | FrameFlags::BULK_PENDING,
                bulk,
                ..FrameHeader::new(K::Response, 7)
            },
            "BULK_PENDING",
        );
        let mut more = pending;
        more.flags |= FrameFlags::BULK_PIECES;
        more.bulk_more = BulkMore::from_slice(&[BulkDesc {
            addr: 1,
            len: 1,
            rkey: 1,
        }])
        .unwrap();
        refused(more, "BULK_PENDING");
        // A version-4 peer's frame is refused (the handshake refuses it first).
        let mut buf = [0u8; MAX_HEADER_LEN];
        let n = ready.encode(&mut buf).unwrap();
        buf[0] = 4;
        assert!(matches!(decode(&buf[..n]), Err(WireError::BadVersion(4))));
    }

    #[test]
    fn consistency_rules() {
        use FrameKind as K;
        let bad = |h: FrameHeader| -> bool {
            let mut buf = [0u8; MAX_HEADER_LEN];
            matches!(h.encode(&mut buf), Err(WireError::Inconsistent(_)))
        };
        let bulk = Some(BulkDesc {
            addr: 1,
            len: 10,
            rkey: 2,
        });
        // Bulk with inline payload.
        assert!(bad(FrameHeader {
            flags: FrameFlags::HAS_BULK,
            bulk,
            payload_len: 1,
            ..FrameHeader::new(K::Response, 1)
        }));
        // Bulk on a Status.
        assert!(bad(FrameHeader {
            flags: FrameFlags::HAS_BULK,
            bulk,
            ..FrameHeader::new(K::Status, 1)
        }));
        // WRITTEN on a StreamMessage, WRITTEN with bulk.
        assert!(bad(FrameHeader {
            flags: FrameFlags::WRITTEN,
            ..FrameHeader::new(K::StreamMessage, 1)
        }));
        assert!(bad(FrameHeader {
            flags: FrameFlags::WRITTEN | FrameFlags::HAS_BULK,
            bulk,
            ..FrameHeader::new(K::Response, 1)
        }));
        // Method id 0, status code 256, empty grant, seq on a Response, payload on a Cancel.
        assert!(bad(FrameHeader::new(K::Request, 1)));
        assert!(bad(FrameHeader {
            aux: 256,
            ..FrameHeader::new(K::Status, 1)
        }));
        assert!(bad(FrameHeader::new(K::WindowUpdate, 1)));
        assert!(bad(FrameHeader {
            seq: 1,
            ..FrameHeader::new(K::Response, 1)
        }));
        assert!(bad(FrameHeader {
            payload_len: 1,
            ..FrameHeader::new(K::Cancel, 1)
        }));
        // Client-streaming request with a payload; call id 0 on a call frame.
        assert!(bad(FrameHeader {
            aux: 5,
            payload_len: 1,
            ..FrameHeader::new(K::Request, 1)
        }));
        assert!(bad(FrameHeader::new(K::Cancel, 0)));
        // PACKED: only on a StreamMessage without bulk, counting 1 message or more, each
        // with room for its length.
        let packed = |aux, payload_len| FrameHeader {
            flags: FrameFlags::PACKED,
            aux,
            payload_len,
            ..FrameHeader::new(K::StreamMessage, 1)
        };
        assert!(!bad(packed(2, 8)));
        assert!(bad(packed(0, 8)), "no message");
        assert!(bad(packed(3, 8)), "no room for three lengths");
        assert!(bad(FrameHeader {
            kind: K::Response,
            ..packed(2, 8)
        }));
        assert!(bad(FrameHeader {
            flags: FrameFlags::PACKED | FrameFlags::HAS_BULK,
            bulk,
            payload_len: 0,
            ..packed(1, 0)
        }));
        // And some that are fine.
        assert!(!bad(FrameHeader {
            aux: 255,
            payload_len: 10,
            metadata_len: 4,
            ..FrameHeader::new(K::Status, 1)
        }));
        assert!(!bad(FrameHeader {
            seq: 7,
            ..FrameHeader::new(K::EndOfStream, 1)
        }));
        assert!(!bad(FrameHeader::new(K::GoAway, 0)));
    }

    /// A Request whose payload is three remote ranges (the client's staged encoding around a
    /// large `bytes` field sent from where it lies).
    fn pieces_request() -> FrameHeader {
        let d = |addr, len, rkey| BulkDesc { addr, len, rkey };
        FrameHeader {
            flags: FrameFlags::HAS_DEADLINE
                | FrameFlags::HAS_BULK
                | FrameFlags::BULK_PIECES
                | FrameFlags::HAS_LANDING
                | FrameFlags::END_STREAM,
            aux: 3,
            metadata_len: 2,
            deadline: Some(77),
            bulk: Some(d(0x1000, 6, 11)),
            bulk_more: BulkMore::from_slice(&[d(0x7f00_0000, 16 << 20, 12), d(0x1006, 9, 11)])
                .unwrap(),
            landing: Some(d(0x9000, 1 << 20, 13)),
            ..FrameHeader::new(FrameKind::Request, 5)
        }
    }

    #[test]
    fn bulk_pieces_round_trip_at_fixed_offsets() {
        let h = pieces_request();
        assert_eq!(h.encoded_len(), MAX_HEADER_LEN);
        assert_eq!(h.bulk_len(), 6 + (16 << 20) + 9);
        let buf = encode_frame(&h, b"md", &[]);
        let f = decode(&buf).unwrap();
        assert_eq!(f.header, h);
        assert_eq!(f.metadata, b"md");
        // deadline at 24, bulk at 32, count and pad at 56, pieces at 64 and 88, landing at 112.
        assert_eq!(&buf[56..64], &[2, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&buf[64..72], &0x7f00_0000u64.to_le_bytes());
        assert_eq!(&buf[88..96], &0x1006u64.to_le_bytes());
        assert_eq!(&buf[112..120], &0x9000u64.to_le_bytes());
        // One further piece, no deadline or landing.
        let one = FrameHeader {
            flags: FrameFlags::HAS_BULK | FrameFlags::BULK_PIECES | FrameFlags::END_STREAM,
            deadline: None,
            landing: None,
            bulk_more: BulkMore::from_slice(&h.bulk_more.as_slice()[..1]).unwrap(),
            ..h
        };
        assert_eq!(one.encoded_len(), BASE_HEADER_LEN + 24 + 8 + 24);
        let buf = encode_frame(&one, b"md", &[]);
        let f = decode(&buf).unwrap();
        assert_eq!(f.header, one);
        assert_eq!(f.header.bulk_more.as_slice(), &h.bulk_more.as_slice()[..1]);
        assert!(BulkMore::from_slice(&[BulkDesc::default(); MAX_BULK_PIECES]).is_none());
    }

    #[test]
    fn malformed_bulk_pieces_are_refused() {
        let good = encode_frame(&pieces_request(), b"md", &[]);
        let inconsistent = |b: &[u8], what: &str| match decode(b) {
            Err(WireError::Inconsistent(m)) => assert!(m.contains(what), "{m}"),
            other => panic!("{what}: {other:?}"),
        };
        // Count 0 and count above MAX_BULK_PIECES - 1.
        for count in [0u32, MAX_BULK_PIECES as u32, u32::MAX] {
            let mut b = good.clone();
            b[56..60].copy_from_slice(&count.to_le_bytes());
            inconsistent(&b, "piece count");
        }
        // Nonzero padding after the count, and in a piece.
        let mut b = good.clone();
        b[60] = 1;
        inconsistent(&b, "padding");
        let mut b = good.clone();
        b[64 + 20] = 1;
        inconsistent(&b, "padding");
        // A piece of length 0.
        let mut b = good.clone();
        b[72..80].fill(0);
        inconsistent(&b, "length 0");
        // Lengths that overflow u64 together.
        let mut b = good.clone();
        b[72..80].copy_from_slice(&u64::MAX.to_le_bytes());
        inconsistent(&b, "2^64");
        // The flag without HAS_BULK, and on a Response.
        let h = FrameHeader {
            bulk: None,
            ..pieces_request()
        };
        let mut buf = [0u8; MAX_HEADER_LEN];
        assert!(
            matches!(h.encode(&mut buf), Err(WireError::Inconsistent(m)) if m.contains("HAS_BULK"))
        );
        let mut b = good.clone();
        b[2] &= !(FrameFlags::HAS_BULK.bits() as u8);
        assert!(matches!(decode(&b), Err(WireError::Inconsistent(_))));
        let h = FrameHeader {
            kind: FrameKind::Response,
            flags: FrameFlags::HAS_BULK | FrameFlags::BULK_PIECES,
            aux: 0,
            deadline: None,
            landing: None,
            metadata_len: 0,
            ..pieces_request()
        };
        assert!(
            matches!(h.encode(&mut buf), Err(WireError::Inconsistent(m)) if m.contains("Request"))
        );
        // Flag and extension disagree.
        let h = FrameHeader {
            flags: pieces_request().flags.with(FrameFlags::BULK_PIECES, false),
            ..pieces_request()
        };
        assert!(
            matches!(h.encode(&mut buf), Err(WireError::Inconsistent(m)) if m.contains("disagree"))
        );
        // Cut anywhere inside the extension: truncated, never a panic.
        for cut in 56..112 {
            assert!(
                matches!(decode(&good[..cut]), Err(WireError::Truncated { .. })),
                "{cut}"
            );
        }
    }

    #[test]
    fn flags_debug_names_bits() {
        let f = FrameFlags::HAS_BULK | FrameFlags::END_STREAM;
        assert_eq!(format!("{f:?}"), "HAS_BULK | END_STREAM");
        assert_eq!(format!("{:?}", FrameFlags::EMPTY), "(empty)");
        assert_eq!(FrameFlags::from_bits(0x1000), None);
        assert_eq!(format!("{:?}", FrameFlags::BULK_PENDING), "BULK_PENDING");
        assert_eq!(format!("{:?}", FrameFlags::PACKED), "PACKED");
        assert_eq!(format!("{:?}", FrameFlags::RECLAIM), "RECLAIM");
        assert_eq!(format!("{:?}", FrameFlags::MORE), "MORE");
        assert_eq!(
            format!("{:?}", FrameFlags::BULK_PIECES | FrameFlags::HAS_BULK),
            "HAS_BULK | BULK_PIECES"
        );
        assert!(
            !f.with(FrameFlags::HAS_BULK, false)
                .contains(FrameFlags::HAS_BULK)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4096))]
        /// The plain-frame shortcut of `check` never passes a header the full walk refuses:
        /// random headers, sound or not, of every kind, with every known flag.
        #[test]
        fn the_check_shortcut_agrees_with_every_rule(
            k in 1u8..=11,
            bits in 0u16..=0xfff,
            plain in any::<bool>(),
            call in prop_oneof![Just(0u32), Just(1), any::<u32>()],
            aux in prop_oneof![Just(0u32), Just(1), Just(255), Just(256), any::<u32>()],
            seq in prop_oneof![Just(0u32), Just(1)],
            md in prop_oneof![Just(0u16), Just(3)],
            payload in prop_oneof![Just(0u32), Just(1), Just(32)],
            deadline in proptest::option::of(any::<u64>()),
            bulk in proptest::option::of(arb_bulk()),
            landing in proptest::option::of(arb_bulk()),
        ) {
            // Half the cases only carry the flags a plain frame may have.
            let bits = if plain { bits & PLAIN_FLAGS.bits() } else { bits };
            let h = FrameHeader {
                kind: FrameKind::from_u8(k).unwrap(),
                flags: FrameFlags::from_bits(bits).unwrap(),
                call_id: call,
                aux,
                credits: 0,
                metadata_len: md,
                payload_len: payload,
                seq,
                deadline,
                bulk: if plain { None } else { bulk },
                bulk_more: BulkMore::NONE,
                landing: if plain { None } else { landing },
            };
            prop_assert_eq!(h.check(), h.check_all());
            if h.is_plain_and_sound() {
                prop_assert_eq!(h.check_all(), Ok(()));
            }
        }
    }

    fn arb_bulk() -> impl Strategy<Value = BulkDesc> {
        (any::<u64>(), 1..u64::MAX, any::<u32>()).prop_map(|(addr, len, rkey)| BulkDesc {
            addr,
            len,
            rkey,
        })
    }

    /// Headers that satisfy every rule, of every kind.
    pub(crate) fn arb_valid_header() -> impl Strategy<Value = FrameHeader> {
        (
            1u8..=11,
            1u32..,
            any::<u32>(),
            any::<u16>(),
            any::<u16>(),
            any::<u32>(),
            any::<u32>(),
            proptest::option::of(any::<u64>()),
            proptest::option::of(arb_bulk()),
            proptest::option::of(arb_bulk()),
            any::<(bool, bool, bool)>(),
            proptest::collection::vec(
                (any::<u64>(), 1..u64::MAX >> 4, any::<u32>()),
                0..MAX_BULK_PIECES,
            ),
        )
            .prop_map(
                |(
                    k,
                    call,
                    aux,
                    credits,
                    md,
                    payload,
                    seq,
                    deadline,
                    bulk,
                    landing,
                    (a, b, c),
                    more,
                )| {
                    use FrameKind as K;
                    let kind = FrameKind::from_u8(k).unwrap();
                    let mut h = FrameHeader {
                        credits,
                        ..FrameHeader::new(kind, call)
                    };
                    match kind {
                        K::Request => {
                            h.aux = aux.max(1);
                            h.deadline = deadline;
                            h.landing = landing;
                            h.flags = FrameFlags::EMPTY
                                .with(FrameFlags::HAS_DEADLINE, deadline.is_some())
                                .with(FrameFlags::HAS_LANDING, landing.is_some())
                                .with(FrameFlags::END_STREAM, a)
                                .with(FrameFlags::SERVER_STREAM, b);
                            h.metadata_len = md;
                            if a {
                                h.payload_len = payload;
                                if h.payload_len == 0 && bulk.is_some() {
                                    h.bulk = bulk
                                        .map(|b| BulkDesc {
                                            len: b.len >> 4,
                                            ..b
                                        })
                                        .filter(|b| b.len > 0);
                                    h.flags = h.flags.with(FrameFlags::HAS_BULK, h.bulk.is_some());
                                    if h.bulk.is_some() && !more.is_empty() {
                                        let more: Vec<BulkDesc> = more
                                            .iter()
                                            .map(|&(addr, len, rkey)| BulkDesc { addr, len, rkey })
                                            .collect();
                                        h.bulk_more = BulkMore::from_slice(&more).unwrap();
                                        h.flags |= FrameFlags::BULK_PIECES;
                                    } else if h.bulk.is_some() && c {
                                        h.flags |= FrameFlags::BULK_PENDING;
                                    }
                                }
                            }
                        }
                        K::Response | K::StreamMessage => {
                            h.metadata_len = md;
                            if c && bulk.is_some() {
                                h.bulk = bulk;
                                h.flags |= FrameFlags::HAS_BULK;
                            } else {
                                h.payload_len = payload;
                                if kind == K::Response && a {
                                    h.flags |= FrameFlags::WRITTEN;
                                }
                            }
                            if kind == K::StreamMessage {
                                h.seq = seq;
                            }
                        }
                        K::Status => {
                            h.aux = aux & 0xff;
                            h.metadata_len = md;
                            h.payload_len = payload;
                        }
                        K::EndOfStream => h.seq = seq,
                        K::WindowUpdate => h.aux = aux.max(1),
                        K::CreditUpdate | K::GoAway => h.call_id = 0,
                        K::BulkReady => {
                            h.aux = aux;
                            h.seq = if aux == 0 { seq.max(1) } else { seq };
                        }
                        K::Cancel | K::BulkRelease => {}
                    }
                    h
                },
            )
    }

    proptest! {
        #[test]
        fn valid_headers_round_trip(h in arb_valid_header()) {
            let mut buf = [0u8; MAX_HEADER_LEN];
            let n = h.encode(&mut buf).unwrap();
            prop_assert_eq!(n, h.encoded_len());
            // Metadata and payload may be huge in the header; decode only the header bytes
            // plus what they claim, so check the header part and the length error.
            let claimed = h.frame_len();
            match decode(&buf[..n]) {
                Ok(f) => {
                    prop_assert_eq!(claimed, n as u64);
                    prop_assert_eq!(f.header, h);
                }
                Err(WireError::Truncated { need, have }) => {
                    prop_assert!(claimed > n as u64);
                    prop_assert_eq!(have, n);
                    prop_assert!(need > n);
                }
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }

        #[test]
        fn valid_small_frames_round_trip(h in arb_valid_header(), md in 0u16..64, pl in 0u32..256) {
            let mut h = h;
            h.metadata_len = if h.metadata_len == 0 { 0 } else { md };
            h.payload_len = if h.payload_len == 0 { 0 } else { pl };
            let mdv: Vec<u8> = (0..h.metadata_len).map(|i| i as u8).collect();
            let plv: Vec<u8> = (0..h.payload_len).map(|i| (i * 7) as u8).collect();
            let buf = encode_frame(&h, &mdv, &plv);
            let f = decode(&buf).unwrap();
            prop_assert_eq!(f.header, h);
            prop_assert_eq!(f.metadata, &mdv[..]);
            prop_assert_eq!(f.payload, &plv[..]);
        }

        #[test]
        fn batches_round_trip_and_every_cut_is_refused(
            hs in proptest::collection::vec(arb_valid_header(), 1..6),
            md in 0u16..32,
            pl in 0u32..64,
        ) {
            // The frames of one SEND, back to back, MORE on all but the last (WRITTEN
            // Responses are never batched: made plain here).
            let mut want = Vec::new();
            let mut buf = Vec::new();
            let n = hs.len();
            for (i, mut h) in hs.into_iter().enumerate() {
                h.flags = h.flags.with(FrameFlags::WRITTEN, false);
                h.metadata_len = if h.metadata_len == 0 { 0 } else { md };
                h.payload_len = if h.payload_len == 0 { 0 } else { pl };
                let mdv: Vec<u8> = (0..h.metadata_len).map(|j| (i + j as usize) as u8).collect();
                let plv: Vec<u8> = (0..h.payload_len).map(|j| (i * 3 + j as usize) as u8).collect();
                let at = buf.len();
                buf.extend_from_slice(&encode_frame(&h, &mdv, &plv));
                if i + 1 < n {
                    mark_more(&mut buf[at..]).unwrap();
                    h.flags |= FrameFlags::MORE;
                }
                want.push((at, h, mdv, plv));
            }
            let got: Vec<_> = Batch::new(&buf).collect::<Result<_, _>>().unwrap();
            prop_assert_eq!(got.len(), n);
            for ((at, f), (wat, h, mdv, plv)) in got.iter().zip(&want) {
                prop_assert_eq!(at, wat);
                prop_assert_eq!(&f.header, h);
                prop_assert_eq!(f.metadata, &mdv[..]);
                prop_assert_eq!(f.payload, &plv[..]);
            }
            // Every shorter SEND fails somewhere, and one with a byte more too: nothing is
            // delivered past a cut silently.
            for cut in 0..buf.len() {
                prop_assert!(Batch::new(&buf[..cut]).any(|r| r.is_err()), "cut at {}", cut);
            }
            let mut longer = buf.clone();
            longer.push(0);
            prop_assert!(Batch::new(&longer).any(|r| r.is_err()));
        }
    }

    fn status(code: u32, payload: &[u8]) -> Vec<u8> {
        let h = FrameHeader {
            aux: code,
            payload_len: payload.len() as u32,
            ..FrameHeader::new(FrameKind::Status, 9)
        };
        encode_frame(&h, &[], payload)
    }

    #[test]
    fn a_batch_decodes_frame_by_frame() {
        let mut buf = status(0, b"one");
        mark_more(&mut buf).unwrap();
        let second = buf.len();
        buf.extend_from_slice(&status(5, b"two!"));
        let frames: Vec<_> = Batch::new(&buf).collect::<Result<_, _>>().unwrap();
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[0].0, 0);
        assert!(frames[0].1.header.flags.contains(FrameFlags::MORE));
        assert_eq!(frames[0].1.payload, b"one");
        assert_eq!(frames[1].0, second);
        assert_eq!(frames[1].1.header.aux, 5);
        assert_eq!(frames[1].1.payload, b"two!");
        // `next_in_batch` is the step the runtime takes.
        let f = decode(&buf).unwrap();
        assert_eq!(next_in_batch(&buf, 0, &f), Ok(Some(second)));
        let f = decode(&buf[second..]).unwrap();
        assert_eq!(next_in_batch(&buf, second, &f), Ok(None));
    }

    #[test]
    fn malformed_batches_are_refused_with_reasons() {
        // MORE on the last frame: the announced frame is missing.
        let mut lone = status(0, b"x");
        mark_more(&mut lone).unwrap();
        let f = decode(&lone).unwrap();
        let e = next_in_batch(&lone, 0, &f).unwrap_err();
        assert_eq!(e, WireError::BatchTruncated { at: lone.len() });
        assert!(e.to_string().contains("MORE"), "{e}");
        // Bytes after a frame without MORE.
        let mut trailing = status(0, b"x");
        let end = trailing.len();
        trailing.extend_from_slice(&[0; 5]);
        let f = decode(&trailing).unwrap();
        let e = next_in_batch(&trailing, 0, &f).unwrap_err();
        assert_eq!(e, WireError::BatchTrailing { end, len: end + 5 });
        assert!(
            e.to_string().contains("5 bytes after the last frame"),
            "{e}"
        );
        // A second frame cut short: the decode of the second frame says so.
        let mut cut = status(0, b"one");
        mark_more(&mut cut).unwrap();
        let second = status(0, b"two");
        cut.extend_from_slice(&second[..second.len() - 1]);
        let r: Vec<_> = Batch::new(&cut).collect();
        assert!(r[0].is_ok());
        assert!(
            matches!(r[1], Err(WireError::Truncated { .. })),
            "{:?}",
            r[1]
        );
        assert_eq!(r.len(), 2, "the walk stops at the first error");
        // Garbage after a MORE frame.
        let mut garbage = status(0, b"one");
        mark_more(&mut garbage).unwrap();
        garbage.extend_from_slice(&[0xee; 30]);
        let r: Vec<_> = Batch::new(&garbage).collect();
        assert!(
            matches!(r[1], Err(WireError::BadVersion(0xee))),
            "{:?}",
            r[1]
        );
        // A landing-zone frame is never part of a batch.
        let written = FrameHeader {
            flags: FrameFlags::WRITTEN | FrameFlags::MORE,
            ..FrameHeader::new(FrameKind::Response, 3)
        };
        assert!(matches!(
            written.check(),
            Err(WireError::Inconsistent(m)) if m.contains("MORE")
        ));
        let mut w = encode_frame(
            &FrameHeader {
                flags: FrameFlags::WRITTEN,
                ..written
            },
            &[],
            &[],
        );
        assert!(matches!(mark_more(&mut w), Err(WireError::Inconsistent(_))));
        // Marking bytes that are no header fails instead of writing.
        let mut junk = [0u8; 8];
        assert!(mark_more(&mut junk).is_err());
        assert_eq!(junk, [0; 8]);
        // Only the fixed part is read, but a header cut short, an unknown kind or unknown
        // flags still refuse, and write nothing.
        let whole = status(0, b"one");
        let mut cut = whole[..BASE_HEADER_LEN - 1].to_vec();
        assert_eq!(
            mark_more(&mut cut),
            Err(WireError::Truncated {
                need: BASE_HEADER_LEN,
                have: BASE_HEADER_LEN - 1
            })
        );
        assert_eq!(cut, whole[..BASE_HEADER_LEN - 1]);
        let mut kind = whole.clone();
        kind[1] = 0xff;
        assert_eq!(mark_more(&mut kind), Err(WireError::UnknownKind(0xff)));
        let mut flags = whole.clone();
        flags[3] = 0x80;
        let before = flags.clone();
        assert!(matches!(
            mark_more(&mut flags),
            Err(WireError::UnknownFlags(_))
        ));
        assert_eq!(flags, before);
        // Marked twice is marked once.
        let mut twice = whole.clone();
        mark_more(&mut twice).unwrap();
        let once = twice.clone();
        mark_more(&mut twice).unwrap();
        assert_eq!(twice, once);
    }
}
