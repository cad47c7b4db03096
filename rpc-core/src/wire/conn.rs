//! [`Conn`]: the protocol state of one connection (one QP), for one role. Calls, credits,
//! stream windows and deadlines; no I/O and no clock.
//!
//! The runtime drives it like quinn-proto's `Connection`:
//!
//! - **getters** (`&self`): [`Conn::send_credits`], [`Conn::poll_timeout`],
//!   [`Conn::wants_credit_update`], [`Conn::plan`], ...
//! - **inputs**: [`Conn::handle_frame`] for every received frame (it returns what happened as
//!   an [`Event`]), [`Conn::recv_reposted`] when receive slots are posted again,
//!   [`Conn::expire`] when [`Conn::poll_timeout`] has passed;
//! - **commands**: [`Conn::start_call`], the frame builders ([`Conn::request`],
//!   [`Conn::response`], [`Conn::status`], [`Conn::stream_message`], [`Conn::end_of_stream`],
//!   [`Conn::cancel`], [`Conn::window_update`], [`Conn::bulk_release`],
//!   [`Conn::credit_update`], [`Conn::go_away`]), [`Conn::cancel_local`] and [`Conn::finish`].
//!
//! # Credits from a shared receive pool
//!
//! A receiver with a receive ring of its own owes the peer one credit for every slot it
//! reposts ([`Conn::recv_reposted`]), so the peer's credits never exceed the ring
//! (`recv_depth == recv_max`). A server that receives every connection's frames through one
//! pool of a shard (a shared receive queue) instead *grants*: each connection has a window of
//! pool slots (`peer credits + frames not yet reposted + credits owed`, [`Conn::window`]),
//! starting at `recv_depth` and never above `recv_max`. The pool's owner grows it with
//! [`Conn::grant`] (credits owed like reposted slots), shrinks it when a slot goes back to the
//! pool instead of to the peer ([`Conn::recv_withheld`]), and takes back credits the peer holds
//! but does not use with [`Conn::reclaim`]: a CreditUpdate with [`FrameFlags::RECLAIM`] asking
//! the peer to keep at most `aux` credits, which the peer answers with a CreditUpdate with
//! RECLAIM saying how many it gave back ([`Event::Surrendered`]). The sum of the windows of a
//! pool's connections never exceeds its slots, so a sender still never sends a frame the
//! receiver has no receive posted for.
//!
//! A builder that returns `Ok(header)` has committed the frame: its credit is spent and the
//! call's state moved, so the runtime must send it (encode the header, write metadata and
//! payload after it, post it). A builder that returns `Err` changed nothing.

use std::fmt;

use super::deadlines::Deadlines;
use super::error::{ProtocolError, SendError, StartError, WireError};
use super::frame::{BulkDesc, BulkMore, FrameFlags, FrameHeader, FrameKind, MAX_HEADER_LEN};
use crate::method::CallKind;

/// Which end of the connection this is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Starts calls.
    Client,
    /// Answers them.
    Server,
}

/// A call on a connection: the client's call-table slot in the low 16 bits and the slot's
/// generation (never 0) in the high 16 bits. The server uses the client's ids, so both ends
/// name a call alike, and a late frame for a finished call (older generation) is recognised as
/// stale instead of reaching the slot's next call. Id 0 is no call.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct CallId(pub u32);

impl CallId {
    /// The id of `slot` at `generation`.
    pub const fn new(slot: u16, generation: u16) -> CallId {
        CallId(slot as u32 | (generation as u32) << 16)
    }

    /// The call-table slot.
    pub const fn slot(self) -> u32 {
        self.0 & 0xffff
    }

    /// The slot's generation.
    pub const fn generation(self) -> u16 {
        (self.0 >> 16) as u16
    }
}

impl fmt::Debug for CallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CallId({}#{})", self.slot(), self.generation())
    }
}

impl fmt::Display for CallId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "call {}#{}", self.slot(), self.generation())
    }
}

/// Limits and tuning of one connection. The runtime fills the `peer_*`, credit and size fields
/// from the handshake; see [`Config::validate`] for the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// Size of our call table: calls a client may have in flight (at most 65,536).
    pub max_calls: u32,
    /// Size of the peer's call table (at most 65,536); a server indexes its table by the
    /// client's call-id slot, so its table has this size.
    pub peer_max_calls: u32,
    /// Receive slots the peer posted for us at the start: our send credits
    /// (`reserved_credits + 2 ..= 65,535`).
    pub initial_send_credits: u32,
    /// The most send credits we can ever hold: the peer's ring depth, or the most it grants
    /// from a shared pool (`initial_send_credits ..= 65,535`).
    pub max_send_credits: u32,
    /// Receive slots we post for the peer at the start: its credits
    /// (`reserved_credits + 2 ..= 65,535`).
    pub recv_depth: u32,
    /// The most credits we ever give the peer (`recv_depth ..= 65,535`): `recv_depth` for a
    /// ring of our own, more when we grant from a shared pool ([`Conn::grant`]).
    pub recv_max: u32,
    /// Credits only control frames may use (at least 2: the last credit is kept for
    /// CreditUpdate, the one before for Cancel, Status, WindowUpdate, BulkRelease, GoAway).
    /// Both ends must use the same value.
    pub reserved_credits: u32,
    /// Owed credits at which the runtime should send a CreditUpdate when no other frame
    /// carries them back (at least 2, at most `recv_max`).
    pub credit_update_threshold: u32,
    /// The largest frame (header, metadata and inline payload) sent in a receive slot; at
    /// most the peer's slot size.
    pub eager_limit: u32,
    /// The largest message, inline or bulk; larger ones are RESOURCE_EXHAUSTED.
    pub max_message: u64,
    /// Stream messages a receiver accepts per call before it grants more (WindowUpdate): the
    /// window every stream starts with. Both ends must use the same value.
    pub stream_window: u32,
    /// The most a stream's window may be opened to by grants (`stream_window ..=`): a
    /// receiver grants past the initial window to let a stream of small messages run ahead
    /// (how far is the receiver's policy, not the protocol's). Both ends must use the same
    /// value (the handshake fixes it).
    pub stream_window_max: u32,
}

/// Smallest `eager_limit`: the longest header and a little metadata.
pub const MIN_EAGER_LIMIT: u32 = 256;
/// Most calls in one call table (16-bit slots).
pub const MAX_CALLS: u32 = 1 << 16;
/// Deepest receive ring (credits travel as `u16`).
pub const MAX_RING_DEPTH: u32 = u16::MAX as u32;

impl Config {
    /// The defaults: 1024 calls each way, 128-slot rings, 2 reserved credits, updates every 32
    /// owed credits, 8 KiB eager frames, 256 MiB messages, 16-message stream windows.
    pub const DEFAULT: Config = Config {
        max_calls: 1024,
        peer_max_calls: 1024,
        initial_send_credits: 128,
        max_send_credits: 128,
        recv_depth: 128,
        recv_max: 128,
        reserved_credits: 2,
        credit_update_threshold: 32,
        eager_limit: 8192,
        max_message: 256 << 20,
        stream_window: 16,
        stream_window_max: 16,
    };

    /// Checks every field's range and the relations between them.
    ///
    /// # Errors
    /// [`WireError::InvalidConfig`] naming the first field out of range.
    pub const fn validate(&self) -> Result<(), WireError> {
        match self.problem() {
            Some(why) => Err(WireError::InvalidConfig(why)),
            None => Ok(()),
        }
    }

    /// The first rule the configuration breaks.
    const fn problem(&self) -> Option<&'static str> {
        const fn bad(why: &'static str) -> Option<&'static str> {
            Some(why)
        }
        if self.max_calls == 0 || self.max_calls > MAX_CALLS {
            return bad("max_calls must be 1..=65536");
        }
        if self.peer_max_calls == 0 || self.peer_max_calls > MAX_CALLS {
            return bad("peer_max_calls must be 1..=65536");
        }
        if self.reserved_credits < 2 || self.reserved_credits > MAX_RING_DEPTH {
            return bad(
                "reserved_credits must be at least 2 (one for CreditUpdate, one more for other control frames)",
            );
        }
        // Ring depths of at least reserve + 2 keep credits live: when the peer is down to its
        // reserve and every slot is re-posted, we owe it at least 2, enough for a
        // CreditUpdate (see `wants_credit_update`).
        if self.initial_send_credits < self.reserved_credits + 2
            || self.initial_send_credits > MAX_RING_DEPTH
        {
            return bad("initial_send_credits must be reserved_credits + 2 ..= 65535");
        }
        if self.max_send_credits < self.initial_send_credits
            || self.max_send_credits > MAX_RING_DEPTH
        {
            return bad("max_send_credits must be initial_send_credits ..= 65535");
        }
        if self.recv_depth < self.reserved_credits + 2 || self.recv_depth > MAX_RING_DEPTH {
            return bad("recv_depth must be reserved_credits + 2 ..= 65535");
        }
        if self.recv_max < self.recv_depth || self.recv_max > MAX_RING_DEPTH {
            return bad("recv_max must be recv_depth ..= 65535");
        }
        if self.credit_update_threshold < 2 || self.credit_update_threshold > self.recv_max {
            return bad("credit_update_threshold must be 2..=recv_max");
        }
        if self.eager_limit < MIN_EAGER_LIMIT {
            return bad("eager_limit must be at least 256 bytes");
        }
        if self.max_message < self.eager_limit as u64 {
            return bad("max_message must be at least eager_limit");
        }
        if self.stream_window == 0 {
            return bad("stream_window must be at least 1");
        }
        if self.stream_window_max < self.stream_window {
            return bad("stream_window_max must be at least stream_window");
        }
        None
    }
}

const _: () = assert!(Config::DEFAULT.validate().is_ok());
const _: () = assert!(
    Config::DEFAULT.eager_limit as usize >= MAX_HEADER_LEN + crate::MAX_METADATA_LEN,
    "the default eager frame holds the longest header and full metadata"
);
const _: () = assert!(MIN_EAGER_LIMIT as usize > MAX_HEADER_LEN);

impl Default for Config {
    fn default() -> Config {
        Config::DEFAULT
    }
}

/// How to move a message of a given size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transfer {
    /// Inline in the frame, in a receive slot.
    Eager,
    /// From a registered bulk buffer the receiver RDMA-READs (the frame carries a
    /// [`BulkDesc`]).
    Rendezvous,
    /// A response RDMA-WRITTEN (WRITE_WITH_IMM, immediate = call id) as a whole frame into the
    /// landing zone the client advertised; the frame has [`FrameFlags::WRITTEN`].
    Landing,
    /// Above `max_message` (or metadata too long for a slot): fail the call with
    /// RESOURCE_EXHAUSTED.
    TooLarge,
}

/// What a received frame meant.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Server: a new call. Its deadline is `now + timeout` in the local clock.
    Request {
        /// The call (the client's id).
        call: CallId,
        /// The method id.
        method_id: u32,
        /// Unary or streaming, from the request's flags.
        kind: CallKind,
        /// When the call expires, if it has a deadline.
        deadline_at: Option<u64>,
        /// The request payload to RDMA-READ, if it travelled by rendezvous (its first range).
        bulk: Option<BulkDesc>,
        /// Further ranges of the payload, READ after `bulk` into the same buffer.
        bulk_more: BulkMore,
        /// The payload (`bulk`, one range) is still being written: READ only what
        /// [`Event::BulkReady`] says is ready.
        pending: bool,
        /// Where the response may be RDMA-WRITTEN.
        landing: Option<BulkDesc>,
        /// A call of ours in the same slot that the client gave up without telling us
        /// (it reused the slot): it is forgotten here; drop its handler and send nothing more
        /// for it.
        replaced: Option<CallId>,
    },
    /// Client: the response message (status OK); the call is over.
    Response {
        /// The call.
        call: CallId,
        /// The payload to RDMA-READ, if by rendezvous (release it with BulkRelease after).
        bulk: Option<BulkDesc>,
        /// Whether the frame arrived in the landing zone (WRITE_WITH_IMM).
        written: bool,
    },
    /// Client: the call's final status; the call is over.
    Status {
        /// The call.
        call: CallId,
        /// The gRPC status code.
        code: u8,
    },
    /// A stream message (in sequence, inside the window), or several packed in one frame.
    StreamMessage {
        /// The call.
        call: CallId,
        /// Its sequence number (the first one's, when packed).
        seq: u32,
        /// The payload to RDMA-READ, if by rendezvous.
        bulk: Option<BulkDesc>,
        /// 0 for a frame of one message (its payload); `n >= 1` when the payload holds `n`
        /// packed messages ([`FrameFlags::PACKED`], [`super::packed`]).
        packed: u32,
    },
    /// Server: the client's stream is complete (every message arrived).
    EndOfStream {
        /// The call.
        call: CallId,
    },
    /// Server: the client gave the call up: stop its handler, send nothing more for it.
    Cancel {
        /// The call.
        call: CallId,
    },
    /// Server: the first `ready` bytes of the call's pending payload may be READ (more than
    /// any BulkReady said before, at most the payload's length).
    BulkReady {
        /// The call.
        call: CallId,
        /// Bytes ready, from the start of the payload.
        ready: u64,
    },
    /// The peer granted `grant` more stream messages.
    WindowUpdate {
        /// The call.
        call: CallId,
        /// Messages granted.
        grant: u32,
    },
    /// The peer is done with the bulk buffer(s) we advertised for `call` (delivered whatever
    /// state the call is in: it is about buffers).
    BulkRelease {
        /// The call.
        call: CallId,
    },
    /// The frame only returned credits.
    CreditOnly,
    /// Server: the client answered our [`Conn::reclaim`], giving back `credits` (possibly 0):
    /// the connection's window shrank by that much, and those pool slots are free again.
    Surrendered {
        /// Credits given back.
        credits: u32,
    },
    /// Client: the server is draining; no new calls on this connection.
    GoAway,
    /// A frame for a call that ended here (cancelled, expired, finished, replaced) before it
    /// arrived; nothing to deliver. If `bulk` is set, the peer lent us that buffer: send a
    /// BulkRelease for `call` so it can reuse it.
    Stale {
        /// The call id the frame named.
        call: CallId,
        /// The frame kind.
        kind: FrameKind,
        /// The bulk descriptor the frame carried.
        bulk: Option<BulkDesc>,
    },
}

/// State of a call-table entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// No call.
    Free,
    /// Client: started, request not sent yet.
    Idle,
    /// Request sent (client) or received (server); not ended.
    Open,
    /// Client: the final frame (Response or Status) arrived.
    Done,
    /// Client: given up locally; server: the client's Cancel arrived.
    Cancelled,
    /// The deadline passed.
    Expired,
    /// Server: our final frame (Response or Status) was built.
    Closed,
}

#[derive(Clone, Copy, Debug)]
struct Call {
    /// The full call id (kept when Free: the client derives the next generation from it).
    id: u32,
    state: State,
    kind: CallKind,
    method: u32,
    /// Client: the Request was built.
    sent: bool,
    /// Client: the Cancel was built.
    cancel_sent: bool,
    /// Our stream direction is closed.
    local_closed: bool,
    /// The peer's stream direction is closed.
    remote_closed: bool,
    deadline: Option<u64>,
    /// Length of the landing zone the request advertised, 0 if none.
    landing_len: u64,
    /// Length of a rendezvous payload sent pending ([`FrameFlags::BULK_PENDING`]), 0 if none.
    pending: u64,
    /// Bytes of it the BulkReady frames said are ready so far.
    ready: u64,
    send_seq: u32,
    recv_seq: u32,
    send_window: u32,
    recv_window: u32,
}

impl Call {
    const EMPTY: Call = Call {
        id: 0,
        state: State::Free,
        kind: CallKind::Unary,
        method: 0,
        sent: false,
        cancel_sent: false,
        local_closed: false,
        remote_closed: false,
        deadline: None,
        landing_len: 0,
        pending: 0,
        ready: 0,
        send_seq: 0,
        recv_seq: 0,
        send_window: 0,
        recv_window: 0,
    };
}

/// Classes of frames for credit purposes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    /// Request, Response, StreamMessage, EndOfStream: only above the reserve.
    Data,
    /// Cancel, Status, WindowUpdate, BulkRelease, GoAway: the reserve but the last credit.
    Control,
    /// CreditUpdate: may take the last credit.
    CreditUpdate,
}

/// The protocol state of one connection, for one [`Role`]. Its call table holds entries up
/// to the highest slot used so far (a client takes its lowest free slot first), so an idle
/// connection that made a few calls costs a few entries, not the whole table: it grows once
/// per new slot, never per call.
#[derive(Debug)]
pub struct Conn {
    role: Role,
    cfg: Config,
    /// Client: indexed by our slot; server: by the client's slot. Entries up to the highest
    /// slot used so far ([`Conn::entry`]); those beyond are free.
    calls: Vec<Call>,
    /// Slots of the table: `calls` grows up to this many entries.
    table: usize,
    /// Client: free slots (a stack); unused on a server.
    free: Box<[u32]>,
    free_len: usize,
    deadlines: Deadlines,
    /// Frames we may still send (receive slots the peer has for us).
    send_credits: u32,
    /// Receive slots re-posted but not yet reported to the peer.
    owed: u32,
    /// Frames received whose slots are not re-posted yet.
    unreposted: u32,
    /// Our view of the peer's send credits (never below its real count).
    peer_credits: u32,
    /// Receive slots of ours the peer may be using: `peer_credits + unreposted + owed`
    /// (constant with a ring of our own; see the module docs on shared pools).
    window: u32,
    /// Server: a [`Conn::reclaim`] waits for the client's answer.
    reclaiming: bool,
    /// Client: the server asked for credits back; the next CreditUpdate says how many we gave
    /// ([`Conn::credit_update`]).
    surrender: Option<u32>,
    /// A data frame found no credit since our last frame: the next one says so
    /// ([`FrameFlags::STARVED`]).
    starved: bool,
    /// The peer said it was starved of credits ([`Conn::take_peer_starved`]).
    peer_starved: bool,
    /// Client: GoAway received; server: GoAway sent.
    going_away: bool,
    /// The last frame received had [`FrameFlags::MORE`]: the next one is in the same receive
    /// slot (a batch) and uses no slot of its own.
    batch_follows: bool,
    /// The next frame built is appended to a SEND being assembled ([`Conn::set_joining`]): it
    /// uses no receive slot of the peer, hence no credit.
    joining: bool,
    /// Entries not Free.
    live: u32,
}

impl Conn {
    /// A connection in `role`: its tables grow as slots are first used.
    ///
    /// # Errors
    /// [`WireError::InvalidConfig`] when `cfg` does not [validate](Config::validate).
    pub fn new(role: Role, cfg: Config) -> Result<Conn, WireError> {
        cfg.validate()?;
        let table = match role {
            Role::Client => cfg.max_calls,
            Role::Server => cfg.peer_max_calls,
        } as usize;
        let free: Box<[u32]> = match role {
            // Lowest slot on top of the stack.
            Role::Client => (0..table as u32).rev().collect(),
            Role::Server => Box::new([]),
        };
        Ok(Conn {
            role,
            cfg,
            calls: Vec::new(),
            table,
            free_len: free.len(),
            free,
            deadlines: Deadlines::new(table),
            send_credits: cfg.initial_send_credits,
            owed: 0,
            unreposted: 0,
            peer_credits: cfg.recv_depth,
            window: cfg.recv_depth,
            reclaiming: false,
            surrender: None,
            starved: false,
            peer_starved: false,
            going_away: false,
            batch_follows: false,
            joining: false,
            live: 0,
        })
    }

    // ---- getters ------------------------------------------------------------------------

    /// Our role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// Frames we may send now (any class).
    pub fn send_credits(&self) -> u32 {
        self.send_credits
    }

    /// Data frames we may send now (credits above the reserve).
    pub fn data_credits(&self) -> u32 {
        self.send_credits.saturating_sub(self.cfg.reserved_credits)
    }

    /// Re-posted receive slots not yet reported to the peer.
    pub fn owed_credits(&self) -> u32 {
        self.owed
    }

    /// Our view of the peer's send credits (never below its real count).
    pub fn peer_credits(&self) -> u32 {
        self.peer_credits
    }

    /// Receive slots the peer may be using now: its credits, the frames it sent whose slots
    /// are not reposted yet, and the credits we owe it (see the module docs on shared pools).
    pub fn window(&self) -> u32 {
        self.window
    }

    /// Server: a [`Conn::reclaim`] waits for the client's answer.
    pub fn is_reclaiming(&self) -> bool {
        self.reclaiming
    }

    /// Whether a frame received since the last call said its sender ran out of credits for
    /// data frames ([`FrameFlags::STARVED`]): a receiver that grants from a shared pool grows
    /// the window of such a peer. Clears it.
    pub fn take_peer_starved(&mut self) -> bool {
        std::mem::take(&mut self.peer_starved)
    }

    /// Whether the peer needs more credits than its window gives: a frame said it ran out
    /// for data frames ([`Conn::take_peer_starved`], cleared), or by our count it is down to
    /// its reserve. A receiver that grants ([`Conn::grant`]) grows the window of such a peer.
    pub fn peer_wants_credit(&mut self) -> bool {
        self.take_peer_starved() || self.peer_credits <= self.cfg.reserved_credits
    }

    /// Whether the runtime should send a CreditUpdate now (if no other frame is about to carry
    /// the credits back): at least 2 credits are owed (a CreditUpdate costs the peer one) and
    /// either the threshold is reached or the peer, by our count, is down to its reserve. Ask
    /// after each batch of [`Conn::handle_frame`] and [`Conn::recv_reposted`].
    /// A client that was asked to give credits back ([`FrameFlags::RECLAIM`]) always wants
    /// one: its answer.
    pub fn wants_credit_update(&self) -> bool {
        self.surrender.is_some()
            || (self.owed >= 2
                && (self.owed >= self.cfg.credit_update_threshold
                    || self.peer_credits <= self.cfg.reserved_credits))
    }

    /// Calls in the table (client: started and not finished; server: received and not
    /// finished or replaced).
    pub fn calls_in_flight(&self) -> u32 {
        self.live
    }

    /// Client: the server sent GoAway. Server: we sent it.
    pub fn is_going_away(&self) -> bool {
        self.going_away
    }

    /// The earliest deadline of a pending call: call [`Conn::expire`] once `now` reaches it.
    pub fn poll_timeout(&self) -> Option<u64> {
        self.deadlines.peek().map(|(d, _)| d)
    }

    /// How to move a message of `payload_len` bytes with `metadata_len` bytes of metadata;
    /// `landing_len` is the landing zone the client advertised (server responses only).
    /// Eager when the longest header, the metadata and the payload fit `eager_limit`; else, for
    /// a server with a landing zone that holds the whole frame, Landing; else Rendezvous; above
    /// `max_message`, or with metadata too long for a slot, TooLarge.
    pub fn plan(
        &self,
        payload_len: u64,
        metadata_len: usize,
        landing_len: Option<u64>,
    ) -> Transfer {
        if payload_len > self.cfg.max_message {
            return Transfer::TooLarge;
        }
        let head = (MAX_HEADER_LEN as u64).saturating_add(metadata_len as u64);
        if head > u64::from(self.cfg.eager_limit) {
            return Transfer::TooLarge;
        }
        let frame = head.saturating_add(payload_len);
        if frame <= u64::from(self.cfg.eager_limit) {
            return Transfer::Eager;
        }
        match landing_len {
            Some(l) if self.role == Role::Server && frame <= l => Transfer::Landing,
            _ => Transfer::Rendezvous,
        }
    }

    // ---- inputs -------------------------------------------------------------------------

    /// Says whether the frames built from now on are appended to the SEND the runtime is
    /// assembling (after a frame it marks with [`FrameFlags::MORE`]): such a frame lands in
    /// the same receive slot of the peer as the one before it, so it needs and spends no send
    /// credit (its credit checks pass; owed credits still ride on it). The runtime sets it
    /// just before a builder and clears it right after: a batch is assembled within one turn.
    pub fn set_joining(&mut self, joining: bool) {
        self.joining = joining;
    }

    /// Accounts `n` receive slots posted again: their credits are owed to the peer and ride on
    /// the next frame we build.
    ///
    /// # Errors
    /// [`SendError::Invalid`] when more slots are reported than frames were received.
    pub fn recv_reposted(&mut self, n: u32) -> Result<(), SendError> {
        if n > self.unreposted {
            return Err(SendError::Invalid(
                "more receive slots re-posted than frames received",
            ));
        }
        self.unreposted -= n;
        self.owed += n;
        Ok(())
    }

    /// Accounts `n` receive slots that went back to a shared pool instead of to the peer:
    /// the window shrinks by `n` (see the module docs on shared pools).
    ///
    /// # Errors
    /// [`SendError::Invalid`] when more slots are reported than frames were received, or
    /// when the window would fall below `reserved_credits + 2` (the peer could stall).
    pub fn recv_withheld(&mut self, n: u32) -> Result<(), SendError> {
        if n > self.unreposted {
            return Err(SendError::Invalid(
                "more receive slots withheld than frames received",
            ));
        }
        if self.window - n < self.cfg.reserved_credits + 2 {
            return Err(SendError::Invalid(
                "a window below reserved_credits + 2 could stall the peer",
            ));
        }
        self.unreposted -= n;
        self.window -= n;
        Ok(())
    }

    /// Grows the window by up to `n` credits from a shared pool, never above `recv_max`; the
    /// credits are owed to the peer and ride on the next frame we build. Returns how many
    /// were granted.
    pub fn grant(&mut self, n: u32) -> u32 {
        let g = n.min(self.cfg.recv_max.saturating_sub(self.window));
        self.window += g;
        self.owed += g;
        g
    }

    /// Processes a received, decoded frame (from a receive slot, or from the landing zone for
    /// a [`FrameFlags::WRITTEN`] response): takes its credits, advances the call, and says what
    /// happened. Every receive slot filled is one to re-post and report with
    /// [`Conn::recv_reposted`] when done with it: the frames of a batch share one, so a frame
    /// right after one with [`FrameFlags::MORE`] counts none (the runtime hands the frames of
    /// a batch over in order, one after the other, nothing in between).
    ///
    /// # Errors
    /// A [`ProtocolError`] when the peer broke the protocol: close the connection.
    pub fn handle_frame(&mut self, h: &FrameHeader, now: u64) -> Result<Event, ProtocolError> {
        let follows =
            std::mem::replace(&mut self.batch_follows, h.flags.contains(FrameFlags::MORE));
        if !follows {
            if self.peer_credits == 0 {
                return Err(ProtocolError::NoCredit);
            }
            self.peer_credits -= 1;
            self.unreposted += 1;
        }
        if h.flags.contains(FrameFlags::STARVED) {
            self.peer_starved = true;
        }
        let credits = self.send_credits + u32::from(h.credits);
        if credits > self.cfg.max_send_credits {
            return Err(ProtocolError::CreditOverflow {
                credits,
                max: self.cfg.max_send_credits,
            });
        }
        self.send_credits = credits;

        use FrameKind as K;
        match (self.role, h.kind) {
            (_, K::CreditUpdate) if h.flags.contains(FrameFlags::RECLAIM) => self.on_reclaim(h),
            (_, K::CreditUpdate) => Ok(Event::CreditOnly),
            (_, K::BulkRelease) => {
                let call = self.peer_id(h.call_id)?;
                Ok(Event::BulkRelease { call })
            }
            (Role::Client, K::GoAway) => {
                self.going_away = true;
                Ok(Event::GoAway)
            }
            (Role::Client, K::Response | K::Status | K::StreamMessage | K::WindowUpdate) => {
                self.client_frame(h)
            }
            (Role::Server, K::Request) => self.server_request(h, now),
            (
                Role::Server,
                K::StreamMessage | K::EndOfStream | K::Cancel | K::WindowUpdate | K::BulkReady,
            ) => self.server_frame(h),
            (role, kind) => Err(ProtocolError::WrongDirection { kind, role }),
        }
    }

    /// Moves the earliest call whose deadline is `<= now` to expired and returns it (one per
    /// call: loop until `None`). Later frames for it are [`Event::Stale`]. The runtime fails
    /// it with DEADLINE_EXCEEDED; a client may send [`Conn::cancel`] for it, then
    /// [`Conn::finish`]es it; a server drops its handler and [`Conn::finish`]es it.
    pub fn expire(&mut self, now: u64) -> Option<CallId> {
        let (_, slot) = self.deadlines.pop_due(now)?;
        let c = self.calls.get_mut(slot as usize)?;
        debug_assert!(matches!(c.state, State::Idle | State::Open));
        c.state = State::Expired;
        Some(CallId(c.id))
    }

    // ---- commands: calls ----------------------------------------------------------------

    /// Stream messages we may still send on `call` before the peer grants more window, or
    /// `None` when the call is not live.
    pub fn send_window(&self, call: CallId) -> Option<u32> {
        let i = self.live_call(call).ok()?;
        Some(self.calls[i].send_window)
    }

    /// Client: starts a call of `method_id` (allocates its slot; build its frame with
    /// [`Conn::request`]). With `timeout_ns` the call expires at `now + timeout_ns`.
    ///
    /// # Errors
    /// [`StartError::TooManyCalls`] when `max_calls` calls are in flight (back-pressure: wait
    /// for one to finish); [`StartError::GoingAway`] after the server's GoAway;
    /// [`StartError::NotClient`] on a server; [`StartError::BadMethod`] for method id 0.
    pub fn start_call(
        &mut self,
        method_id: u32,
        kind: CallKind,
        timeout_ns: Option<u64>,
        now: u64,
    ) -> Result<CallId, StartError> {
        if self.role != Role::Client {
            return Err(StartError::NotClient);
        }
        if self.going_away {
            return Err(StartError::GoingAway);
        }
        if method_id == 0 {
            return Err(StartError::BadMethod);
        }
        if self.free_len == 0 {
            return Err(StartError::TooManyCalls);
        }
        let slot = self.free[self.free_len - 1];
        if self.entry(slot as usize).is_none() {
            return Err(StartError::TooManyCalls);
        }
        self.free_len -= 1;
        let c = &mut self.calls[slot as usize];
        let generation = match CallId(c.id).generation() {
            u16::MAX => 1,
            g => g + 1,
        };
        let deadline = timeout_ns.map(|t| now.saturating_add(t));
        *c = Call {
            id: CallId::new(slot as u16, generation).0,
            state: State::Idle,
            kind,
            method: method_id,
            deadline,
            send_window: self.cfg.stream_window,
            recv_window: self.cfg.stream_window,
            ..Call::EMPTY
        };
        let id = CallId(c.id);
        if let Some(d) = deadline {
            self.deadlines.insert(slot, d);
        }
        self.live += 1;
        Ok(id)
    }

    /// Client: the caller gave `call` up (its future was dropped). Returns whether a Cancel
    /// frame should be sent ([`Conn::cancel`]): yes when the request went out and the call
    /// has not ended. Later frames for it are stale. [`Conn::finish`] it when its buffers are
    /// free.
    pub fn cancel_local(&mut self, call: CallId) -> bool {
        if self.role != Role::Client {
            return false;
        }
        let Ok(i) = self.own(call) else {
            return false;
        };
        let c = &mut self.calls[i];
        match c.state {
            State::Idle | State::Open => {
                c.state = State::Cancelled;
                self.deadlines.remove(call.slot());
                c.sent
            }
            State::Cancelled | State::Expired => c.sent && !c.cancel_sent,
            _ => false,
        }
    }

    /// Frees `call`'s entry: the client got its final frame (or gave the call up) and its
    /// buffers are free; the server sent its final frame (or dropped the call). Returns false
    /// when the id is not in the table (already finished, or replaced by a newer call).
    pub fn finish(&mut self, call: CallId) -> bool {
        let slot = call.slot() as usize;
        let Some(c) = self.calls.get_mut(slot) else {
            return false;
        };
        if c.state == State::Free || c.id != call.0 || call.generation() == 0 {
            return false;
        }
        c.state = State::Free;
        self.deadlines.remove(call.slot());
        self.live -= 1;
        if self.role == Role::Client
            && let Some(f) = self.free.get_mut(self.free_len)
        {
            *f = call.slot();
            self.free_len += 1;
        }
        true
    }

    // ---- commands: frames ---------------------------------------------------------------

    /// Client: the Request of `call`, with `payload_len` inline bytes (0 with `bulk`, and for
    /// client-streaming calls), `metadata_len` bytes of metadata, an optional rendezvous
    /// payload and an optional landing zone for the response. Carries the call's time left as
    /// the deadline extension.
    ///
    /// # Errors
    /// [`SendError::NoCredit`] (back-pressure); [`SendError::Expired`] when the deadline has
    /// passed; [`SendError::Gone`] when the call was cancelled or expired;
    /// [`SendError::BadCall`], [`SendError::BadState`] (request already sent, not a client),
    /// [`SendError::Invalid`] (lengths, a frame above `eager_limit`) for caller bugs.
    pub fn request(
        &mut self,
        call: CallId,
        payload_len: usize,
        metadata_len: usize,
        bulk: Option<BulkDesc>,
        landing: Option<BulkDesc>,
        now: u64,
    ) -> Result<FrameHeader, SendError> {
        self.request_pieces(
            call,
            payload_len,
            metadata_len,
            bulk.as_slice(),
            landing,
            now,
        )
    }

    /// Client: like [`Conn::request`], with a rendezvous payload made of up to
    /// [`super::MAX_BULK_PIECES`] remote ranges (`bulk`, in order; empty: no rendezvous). The
    /// server READs them one after the other into one buffer.
    ///
    /// # Errors
    /// As [`Conn::request`]; [`SendError::Invalid`] for too many ranges, one of length 0, or a
    /// total above `max_message`.
    #[inline]
    pub fn request_pieces(
        &mut self,
        call: CallId,
        payload_len: usize,
        metadata_len: usize,
        pieces: &[BulkDesc],
        landing: Option<BulkDesc>,
        now: u64,
    ) -> Result<FrameHeader, SendError> {
        let (bulk, bulk_more) = match pieces.split_first() {
            None => (None, BulkMore::NONE),
            Some((first, rest)) => {
                let more = BulkMore::from_slice(rest)
                    .ok_or(SendError::Invalid("more bulk pieces than MAX_BULK_PIECES"))?;
                if pieces.iter().any(|d| d.len == 0) {
                    return Err(SendError::Invalid("bulk piece of length 0"));
                }
                (Some(*first), more)
            }
        };
        // The length checks see the whole payload.
        let total = pieces
            .iter()
            .try_fold(0u64, |a, d| a.checked_add(d.len))
            .ok_or(SendError::Invalid("bulk payload above max_message"))?;
        let whole = bulk.map(|b| BulkDesc { len: total, ..b });
        if self.role != Role::Client {
            return Err(SendError::BadState("only a client sends a Request"));
        }
        let i = self.own(call)?;
        let c = self.calls[i];
        match c.state {
            State::Idle => {}
            State::Cancelled | State::Expired => return Err(SendError::Gone),
            _ => return Err(SendError::BadState("the call's Request was already sent")),
        }
        let (payload_len, metadata_len) = self.lens(payload_len, metadata_len, whole)?;
        let client_streams = c.kind.client_streams();
        if client_streams && (payload_len != 0 || bulk.is_some()) {
            return Err(SendError::Invalid(
                "a client-streaming call sends its messages as StreamMessage, not in the Request",
            ));
        }
        if let Some(l) = landing {
            if l.len == 0 {
                return Err(SendError::Invalid("landing zone of length 0"));
            }
            if c.kind.server_streams() {
                return Err(SendError::Invalid(
                    "landing zones are for single responses, not server streams",
                ));
            }
        }
        let deadline = match c.deadline {
            Some(d) if d <= now => return Err(SendError::Expired),
            Some(d) => Some(d - now),
            None => None,
        };
        let flags = FrameFlags::EMPTY
            .with(FrameFlags::HAS_DEADLINE, deadline.is_some())
            .with(FrameFlags::HAS_BULK, bulk.is_some())
            .with(FrameFlags::BULK_PIECES, !bulk_more.is_empty())
            .with(FrameFlags::HAS_LANDING, landing.is_some())
            .with(FrameFlags::END_STREAM, !client_streams)
            .with(FrameFlags::SERVER_STREAM, c.kind.server_streams());
        let mut h = FrameHeader {
            flags,
            aux: c.method,
            metadata_len,
            payload_len,
            deadline,
            bulk,
            bulk_more,
            landing,
            ..FrameHeader::new(FrameKind::Request, call.0)
        };
        self.fits_slot(&h)?;
        self.check_credit(Class::Data)?;
        let c = &mut self.calls[i];
        c.state = State::Open;
        c.sent = true;
        c.local_closed = !client_streams;
        c.landing_len = landing.map_or(0, |l| l.len);
        self.stamp(&mut h);
        Ok(h)
    }

    /// Client: like [`Conn::request`] with a rendezvous payload of one range (`bulk`) whose
    /// bytes are still being written ([`FrameFlags::BULK_PENDING`]): the server READs only
    /// what [`Conn::bulk_ready`] frames say is ready.
    ///
    /// # Errors
    /// As [`Conn::request`].
    pub fn request_pending(
        &mut self,
        call: CallId,
        metadata_len: usize,
        bulk: BulkDesc,
        landing: Option<BulkDesc>,
        now: u64,
    ) -> Result<FrameHeader, SendError> {
        let mut h = self.request_pieces(call, 0, metadata_len, &[bulk], landing, now)?;
        h.flags |= FrameFlags::BULK_PENDING;
        self.calls[call.slot() as usize].pending = bulk.len;
        Ok(h)
    }

    /// Client: says that the first `ready` bytes of `call`'s pending payload
    /// ([`Conn::request_pending`]) are written. A control frame.
    ///
    /// # Errors
    /// [`SendError::NoCredit`]; [`SendError::Gone`] when the call ended (the server answered,
    /// or it was cancelled or expired: its payload will not be read); [`SendError::BadState`]
    /// when the call has no pending payload; [`SendError::Invalid`] when `ready` does not grow
    /// or exceeds the payload.
    pub fn bulk_ready(&mut self, call: CallId, ready: u64) -> Result<FrameHeader, SendError> {
        if self.role != Role::Client {
            return Err(SendError::BadState("only a client sends BulkReady"));
        }
        let i = self.own(call)?;
        let c = self.calls[i];
        match c.state {
            State::Open => {}
            State::Idle => return Err(SendError::BadState("the Request was not sent yet")),
            _ => return Err(SendError::Gone),
        }
        if c.pending == 0 {
            return Err(SendError::BadState("the call's payload is not pending"));
        }
        if ready <= c.ready || ready > c.pending {
            return Err(SendError::Invalid(
                "BulkReady must grow and stay within the payload",
            ));
        }
        self.check_credit(Class::Control)?;
        self.calls[i].ready = ready;
        let mut h = FrameHeader {
            aux: ready as u32,
            seq: (ready >> 32) as u32,
            ..FrameHeader::new(FrameKind::BulkReady, call.0)
        };
        self.stamp(&mut h);
        Ok(h)
    }

    /// Server: the Response of a unary or client-streaming `call` (status OK; ends the call).
    /// With `written` the frame goes into the client's landing zone by WRITE_WITH_IMM (it must
    /// fit there) instead of a receive slot.
    ///
    /// # Errors
    /// [`SendError::NoCredit`] (back-pressure); [`SendError::Gone`] when the call ended
    /// (cancelled, expired, replaced); [`SendError::BadState`] for a server-streaming call or
    /// a landing zone the request did not advertise; [`SendError::Invalid`] for lengths.
    #[inline]
    pub fn response(
        &mut self,
        call: CallId,
        payload_len: usize,
        metadata_len: usize,
        bulk: Option<BulkDesc>,
        written: bool,
    ) -> Result<FrameHeader, SendError> {
        if self.role != Role::Server {
            return Err(SendError::BadState("only a server sends a Response"));
        }
        let i = self.peer_call(call)?;
        let c = self.calls[i];
        if c.kind.server_streams() {
            return Err(SendError::BadState(
                "a server-streaming call answers with StreamMessage frames and a Status",
            ));
        }
        let (payload_len, metadata_len) = self.lens(payload_len, metadata_len, bulk)?;
        let mut h = FrameHeader {
            flags: FrameFlags::EMPTY
                .with(FrameFlags::HAS_BULK, bulk.is_some())
                .with(FrameFlags::WRITTEN, written),
            metadata_len,
            payload_len,
            bulk,
            ..FrameHeader::new(FrameKind::Response, call.0)
        };
        if written {
            if c.landing_len == 0 {
                return Err(SendError::BadState(
                    "the request advertised no landing zone",
                ));
            }
            if bulk.is_some() {
                return Err(SendError::Invalid(
                    "a written response carries no bulk descriptor",
                ));
            }
            if h.frame_len() > c.landing_len {
                return Err(SendError::Invalid(
                    "the frame is larger than the landing zone",
                ));
            }
        } else {
            self.fits_slot(&h)?;
        }
        self.check_credit(Class::Data)?;
        self.close_server_call(i);
        self.stamp(&mut h);
        Ok(h)
    }

    /// Server: the final Status of `call` (`code`, a UTF-8 message of `message_len` bytes as
    /// payload, trailers of `metadata_len` bytes); ends the call. A control frame: it may use
    /// the reserved credits.
    ///
    /// # Errors
    /// [`SendError::NoCredit`]; [`SendError::Gone`] when the call ended (cancelled, expired,
    /// replaced); [`SendError::Invalid`] when the frame does not fit `eager_limit`.
    pub fn status(
        &mut self,
        call: CallId,
        code: u8,
        message_len: usize,
        metadata_len: usize,
    ) -> Result<FrameHeader, SendError> {
        if self.role != Role::Server {
            return Err(SendError::BadState("only a server sends a Status"));
        }
        let i = self.peer_call(call)?;
        let (payload_len, metadata_len) = self.lens(message_len, metadata_len, None)?;
        let mut h = FrameHeader {
            aux: u32::from(code),
            metadata_len,
            payload_len,
            ..FrameHeader::new(FrameKind::Status, call.0)
        };
        self.fits_slot(&h)?;
        self.check_credit(Class::Control)?;
        self.close_server_call(i);
        self.stamp(&mut h);
        Ok(h)
    }

    /// A stream message of `call` (client: client-streaming calls before
    /// [`Conn::end_of_stream`]; server: server-streaming calls before the Status), numbered in
    /// sequence; uses one message of the stream's window.
    ///
    /// # Errors
    /// [`SendError::Window`] when the peer's window is closed and [`SendError::NoCredit`]
    /// (back-pressure); [`SendError::Gone`] when the call ended; [`SendError::BadState`] when
    /// the call has no such stream or it is closed; [`SendError::Invalid`] for lengths.
    pub fn stream_message(
        &mut self,
        call: CallId,
        payload_len: usize,
        metadata_len: usize,
        bulk: Option<BulkDesc>,
    ) -> Result<FrameHeader, SendError> {
        let i = self.live_call(call)?;
        let c = self.calls[i];
        let streams = match self.role {
            Role::Client => c.kind.client_streams(),
            Role::Server => c.kind.server_streams(),
        };
        if !streams {
            return Err(SendError::BadState(
                "this call kind has no stream in our direction",
            ));
        }
        if c.local_closed {
            return Err(SendError::BadState(
                "our stream of this call is already closed",
            ));
        }
        let (payload_len, metadata_len) = self.lens(payload_len, metadata_len, bulk)?;
        let mut h = FrameHeader {
            flags: FrameFlags::EMPTY.with(FrameFlags::HAS_BULK, bulk.is_some()),
            metadata_len,
            payload_len,
            seq: c.send_seq,
            bulk,
            ..FrameHeader::new(FrameKind::StreamMessage, call.0)
        };
        self.fits_slot(&h)?;
        if c.send_window == 0 {
            return Err(SendError::Window);
        }
        self.check_credit(Class::Data)?;
        let c = &mut self.calls[i];
        c.send_seq = c.send_seq.wrapping_add(1);
        c.send_window -= 1;
        self.stamp(&mut h);
        Ok(h)
    }

    /// One more message of `call`'s stream, packed into the StreamMessage frame of that call
    /// built last, which is not sent yet (the caller appends the message to it with
    /// [`super::packed::append`]): numbered next in sequence, it uses one message of the
    /// stream's window and no credit (it adds no SEND).
    ///
    /// # Errors
    /// As [`Conn::stream_message`], but never [`SendError::NoCredit`].
    pub fn stream_message_packed(&mut self, call: CallId) -> Result<(), SendError> {
        let i = self.live_call(call)?;
        let c = &mut self.calls[i];
        let streams = match self.role {
            Role::Client => c.kind.client_streams(),
            Role::Server => c.kind.server_streams(),
        };
        if !streams || c.local_closed {
            return Err(SendError::BadState(
                "this call has no open stream in our direction",
            ));
        }
        if c.send_window == 0 {
            return Err(SendError::Window);
        }
        c.send_seq = c.send_seq.wrapping_add(1);
        c.send_window -= 1;
        Ok(())
    }

    /// Client: ends the client's stream of `call` (half-close); carries the number of
    /// messages sent.
    ///
    /// # Errors
    /// [`SendError::NoCredit`]; [`SendError::Gone`] when the call ended;
    /// [`SendError::BadState`] when the call has no client stream or it is already closed.
    pub fn end_of_stream(&mut self, call: CallId) -> Result<FrameHeader, SendError> {
        if self.role != Role::Client {
            return Err(SendError::BadState("only a client sends EndOfStream"));
        }
        let i = self.live_call(call)?;
        let c = self.calls[i];
        if !c.kind.client_streams() {
            return Err(SendError::BadState("this call kind has no client stream"));
        }
        if c.local_closed {
            return Err(SendError::BadState("the client stream is already closed"));
        }
        self.check_credit(Class::Data)?;
        let mut h = FrameHeader {
            seq: c.send_seq,
            ..FrameHeader::new(FrameKind::EndOfStream, call.0)
        };
        self.calls[i].local_closed = true;
        self.stamp(&mut h);
        Ok(h)
    }

    /// Client: the Cancel frame of `call` (after [`Conn::cancel_local`] said so, or for an
    /// open or expired call). A control frame.
    ///
    /// # Errors
    /// [`SendError::NoCredit`]; [`SendError::Gone`] when the call already ended (the server
    /// answered); [`SendError::BadState`] when the request was never sent or the Cancel was
    /// already sent.
    pub fn cancel(&mut self, call: CallId) -> Result<FrameHeader, SendError> {
        if self.role != Role::Client {
            return Err(SendError::BadState("only a client sends Cancel"));
        }
        let i = self.own(call)?;
        let c = self.calls[i];
        match c.state {
            State::Done => return Err(SendError::Gone),
            _ if !c.sent => {
                return Err(SendError::BadState(
                    "the Request was never sent: nothing to cancel, finish the call",
                ));
            }
            _ if c.cancel_sent => return Err(SendError::BadState("Cancel already sent")),
            _ => {}
        }
        self.check_credit(Class::Control)?;
        let c = &mut self.calls[i];
        if c.state == State::Open {
            c.state = State::Cancelled;
            self.deadlines.remove(call.slot());
        }
        c.cancel_sent = true;
        let mut h = FrameHeader::new(FrameKind::Cancel, call.0);
        self.stamp(&mut h);
        Ok(h)
    }

    /// Client: the Cancel of `call` after this end already [`Conn::finish`]ed it: a Cancel
    /// that waited for credit (a control frame queued by the runtime) while the call's
    /// entry was freed. The server may still run the call: it drops it, or sees a stale
    /// frame if it already ended it or a newer call of the slot replaced it. The runtime
    /// builds it at most once per call (it queues a Cancel only when [`Conn::cancel_local`]
    /// says so); a live call's Cancel is [`Conn::cancel`]. A control frame.
    ///
    /// # Errors
    /// [`SendError::NoCredit`]; [`SendError::BadCall`] for an id no call could have had, or
    /// that names the slot's live call.
    pub fn cancel_finished(&mut self, call: CallId) -> Result<FrameHeader, SendError> {
        if self.role != Role::Client {
            return Err(SendError::BadState("only a client sends Cancel"));
        }
        match self.calls.get(call.slot() as usize) {
            Some(c) if call.generation() != 0 && (c.state == State::Free || c.id != call.0) => {}
            _ => return Err(SendError::BadCall(call)),
        }
        self.check_credit(Class::Control)?;
        let mut h = FrameHeader::new(FrameKind::Cancel, call.0);
        self.stamp(&mut h);
        Ok(h)
    }

    /// Grants the peer `grant` more stream messages on `call` (after the application consumed
    /// that many). A control frame.
    ///
    /// # Errors
    /// [`SendError::NoCredit`]; [`SendError::Gone`] when the call ended;
    /// [`SendError::BadState`] when the peer has no stream on this call;
    /// [`SendError::Invalid`] for a grant of 0 or one that opens the window past
    /// [`Config::stream_window_max`].
    pub fn window_update(&mut self, call: CallId, grant: u32) -> Result<FrameHeader, SendError> {
        let i = self.live_call(call)?;
        let c = self.calls[i];
        let peer_streams = match self.role {
            Role::Client => c.kind.server_streams(),
            Role::Server => c.kind.client_streams(),
        };
        if !peer_streams {
            return Err(SendError::BadState("the peer has no stream on this call"));
        }
        if grant == 0 {
            return Err(SendError::Invalid("window grant of 0"));
        }
        if u64::from(c.recv_window) + u64::from(grant) > u64::from(self.cfg.stream_window_max) {
            return Err(SendError::Invalid(
                "window grant opens the window past stream_window_max",
            ));
        }
        self.check_credit(Class::Control)?;
        self.calls[i].recv_window += grant;
        let mut h = FrameHeader {
            aux: grant,
            ..FrameHeader::new(FrameKind::WindowUpdate, call.0)
        };
        self.stamp(&mut h);
        Ok(h)
    }

    /// Tells the peer we are done with the bulk buffer(s) it advertised for `call` (READ
    /// complete, or never going to happen). Allowed whatever state the call is in. A control
    /// frame.
    ///
    /// # Errors
    /// [`SendError::NoCredit`]; [`SendError::BadCall`] for an id outside the call table.
    pub fn bulk_release(&mut self, call: CallId) -> Result<FrameHeader, SendError> {
        if call.generation() == 0 || call.slot() as usize >= self.table {
            return Err(SendError::BadCall(call));
        }
        self.check_credit(Class::Control)?;
        let mut h = FrameHeader::new(FrameKind::BulkRelease, call.0);
        self.stamp(&mut h);
        Ok(h)
    }

    /// A CreditUpdate returning the owed credits (see [`Conn::wants_credit_update`]); on a
    /// client asked to give credits back, also its answer (with [`FrameFlags::RECLAIM`] and
    /// the credits given back in `aux`). May use the last credit.
    ///
    /// # Errors
    /// [`SendError::NoCredit`] with no credit at all; [`SendError::Invalid`] when nothing is
    /// owed or answered.
    pub fn credit_update(&mut self) -> Result<FrameHeader, SendError> {
        if self.owed == 0 && self.surrender.is_none() {
            return Err(SendError::Invalid("CreditUpdate with no credit owed"));
        }
        self.check_credit(Class::CreditUpdate)?;
        let mut h = FrameHeader::new(FrameKind::CreditUpdate, 0);
        if let Some(n) = self.surrender.take() {
            h.flags |= FrameFlags::RECLAIM;
            h.aux = n;
        }
        self.stamp(&mut h);
        Ok(h)
    }

    /// Server granting from a shared pool: asks the client to keep at most `keep` send
    /// credits and give the rest back (a CreditUpdate with [`FrameFlags::RECLAIM`], carrying
    /// the owed credits too). The client answers once, with the number it gave back
    /// ([`Event::Surrendered`]); until then no other reclaim may be sent. A control frame.
    ///
    /// # Errors
    /// [`SendError::BadState`] on a client or with a reclaim outstanding;
    /// [`SendError::Invalid`] when `keep` is below `reserved_credits + 2`;
    /// [`SendError::NoCredit`].
    pub fn reclaim(&mut self, keep: u32) -> Result<FrameHeader, SendError> {
        if self.role != Role::Server {
            return Err(SendError::BadState("only a server reclaims credits"));
        }
        if self.reclaiming {
            return Err(SendError::BadState(
                "a reclaim already waits for its answer",
            ));
        }
        if keep < self.cfg.reserved_credits + 2 {
            return Err(SendError::Invalid(
                "a reclaim must leave the client reserved_credits + 2",
            ));
        }
        self.check_credit(Class::Control)?;
        let mut h = FrameHeader::new(FrameKind::CreditUpdate, 0);
        h.flags |= FrameFlags::RECLAIM;
        h.aux = keep;
        self.stamp(&mut h);
        self.reclaiming = true;
        Ok(h)
    }

    /// Server: GoAway (draining: the client starts no new calls here; calls in flight go on).
    /// A control frame.
    ///
    /// # Errors
    /// [`SendError::NoCredit`]; [`SendError::BadState`] on a client.
    pub fn go_away(&mut self) -> Result<FrameHeader, SendError> {
        if self.role != Role::Server {
            return Err(SendError::BadState("only a server sends GoAway"));
        }
        self.check_credit(Class::Control)?;
        self.going_away = true;
        let mut h = FrameHeader::new(FrameKind::GoAway, 0);
        self.stamp(&mut h);
        Ok(h)
    }

    // ---- internals ----------------------------------------------------------------------

    /// Client: the index of our live `call`.
    fn own(&self, call: CallId) -> Result<usize, SendError> {
        let i = call.slot() as usize;
        match self.calls.get(i) {
            Some(c) if c.id == call.0 && c.state != State::Free && call.generation() != 0 => Ok(i),
            _ => Err(SendError::BadCall(call)),
        }
    }

    /// Server: the index of the client's `call`, if it is still open here.
    fn peer_call(&self, call: CallId) -> Result<usize, SendError> {
        let i = call.slot() as usize;
        match self.calls.get(i) {
            None => Err(SendError::BadCall(call)),
            Some(_) if call.generation() == 0 => Err(SendError::BadCall(call)),
            Some(c) if c.id == call.0 && c.state == State::Open => Ok(i),
            Some(_) => Err(SendError::Gone),
        }
    }

    /// Either role: the index of an open `call` (one that may still carry stream frames).
    fn live_call(&self, call: CallId) -> Result<usize, SendError> {
        match self.role {
            Role::Server => self.peer_call(call),
            Role::Client => {
                let i = self.own(call)?;
                match self.calls[i].state {
                    State::Open => Ok(i),
                    State::Idle => Err(SendError::BadState("the call's Request was not sent yet")),
                    _ => Err(SendError::Gone),
                }
            }
        }
    }

    fn lens(
        &self,
        payload_len: usize,
        metadata_len: usize,
        bulk: Option<BulkDesc>,
    ) -> Result<(u32, u16), SendError> {
        let md = u16::try_from(metadata_len)
            .map_err(|_| SendError::Invalid("metadata longer than 65,535 bytes"))?;
        let pl = u32::try_from(payload_len)
            .map_err(|_| SendError::Invalid("inline payload longer than 4 GiB"))?;
        if let Some(b) = bulk {
            if pl != 0 {
                return Err(SendError::Invalid(
                    "inline payload together with a bulk descriptor",
                ));
            }
            if b.len == 0 {
                return Err(SendError::Invalid("bulk descriptor of length 0"));
            }
            if b.len > self.cfg.max_message {
                return Err(SendError::Invalid("bulk payload above max_message"));
            }
        }
        Ok((pl, md))
    }

    fn fits_slot(&self, h: &FrameHeader) -> Result<(), SendError> {
        if h.frame_len() > u64::from(self.cfg.eager_limit) {
            return Err(SendError::Invalid(
                "frame larger than eager_limit (plan() would choose Rendezvous or Landing)",
            ));
        }
        Ok(())
    }

    fn check_credit(&mut self, class: Class) -> Result<(), SendError> {
        if self.joining {
            return Ok(());
        }
        let need = match class {
            Class::Data => self.cfg.reserved_credits + 1,
            Class::Control => 2,
            Class::CreditUpdate => 1,
        };
        if self.send_credits >= need {
            Ok(())
        } else {
            self.starved |= class == Class::Data;
            Err(SendError::NoCredit)
        }
    }

    /// Spends one credit (none for a frame joining a SEND) and piggy-backs the owed credits
    /// on `h`.
    fn stamp(&mut self, h: &mut FrameHeader) {
        if !self.joining {
            debug_assert!(self.send_credits > 0);
            self.send_credits -= 1;
        }
        if std::mem::take(&mut self.starved) {
            h.flags |= FrameFlags::STARVED;
        }
        let c = self.owed.min(u32::from(u16::MAX));
        h.credits = c as u16;
        self.owed -= c;
        self.peer_credits += c;
    }

    /// A CreditUpdate with [`FrameFlags::RECLAIM`]: on a client, the server's request (give
    /// back what is above `aux`); on a server, the client's answer (`aux` given back).
    fn on_reclaim(&mut self, h: &FrameHeader) -> Result<Event, ProtocolError> {
        match self.role {
            Role::Client => {
                let keep = h.aux;
                if keep < self.cfg.reserved_credits + 2 {
                    return Err(ProtocolError::Reclaim(
                        "asked to keep fewer credits than the reserve needs",
                    ));
                }
                if self.surrender.is_some() {
                    return Err(ProtocolError::Reclaim(
                        "a second reclaim before our answer to the first",
                    ));
                }
                let n = self.send_credits.saturating_sub(keep);
                self.send_credits -= n;
                self.surrender = Some(n);
                Ok(Event::CreditOnly)
            }
            Role::Server => {
                if !self.reclaiming {
                    return Err(ProtocolError::Reclaim(
                        "credits given back that nobody asked for",
                    ));
                }
                let n = h.aux;
                if n > self.peer_credits {
                    return Err(ProtocolError::Reclaim(
                        "more credits given back than the client holds",
                    ));
                }
                // An honest client keeps what we asked (at least the reserve plus two), so
                // the window never falls below that; only a forged answer could.
                if self.window - n < self.cfg.reserved_credits + 2 {
                    return Err(ProtocolError::Reclaim(
                        "credits given back below the reserve the window keeps",
                    ));
                }
                self.peer_credits -= n;
                self.window -= n;
                self.reclaiming = false;
                Ok(Event::Surrendered { credits: n })
            }
        }
    }

    fn close_server_call(&mut self, i: usize) {
        let c = &mut self.calls[i];
        c.state = State::Closed;
        c.local_closed = true;
        self.deadlines.remove(i as u32);
    }

    /// A call id a peer named: inside the table, generation not 0. Its entry exists after
    /// this (a free one for a slot not used before).
    fn peer_id(&mut self, raw: u32) -> Result<CallId, ProtocolError> {
        let call = CallId(raw);
        if call.generation() == 0 || self.entry(call.slot() as usize).is_none() {
            return Err(ProtocolError::BadCallId(raw));
        }
        Ok(call)
    }

    /// The entry of `slot`, made (free, with those below it) the first time the slot is
    /// used; `None` beyond the table.
    #[inline]
    fn entry(&mut self, slot: usize) -> Option<&mut Call> {
        if slot >= self.calls.len() {
            crate::slot_table::grow(&mut self.calls, slot, self.table, || Call::EMPTY);
        }
        self.calls.get_mut(slot)
    }

    /// Entries of the call table made so far (tests).
    #[cfg(test)]
    pub(crate) fn table_entries(&self) -> usize {
        self.calls.len()
    }

    fn check_bulk(&self, call: CallId, h: &FrameHeader) -> Result<(), ProtocolError> {
        match h.bulk_len() {
            len if len > self.cfg.max_message => Err(ProtocolError::TooLarge {
                call,
                len,
                max: self.cfg.max_message,
            }),
            _ => Ok(()),
        }
    }

    /// A stream message into entry `i`: window and sequence.
    fn recv_stream_message(
        &mut self,
        i: usize,
        call: CallId,
        h: &FrameHeader,
    ) -> Result<Event, ProtocolError> {
        self.check_bulk(call, h)?;
        // `decode` checked that a packed frame counts at least one message.
        let packed = if h.flags.contains(FrameFlags::PACKED) {
            h.aux
        } else {
            0
        };
        let c = &mut self.calls[i];
        if c.recv_window < packed.max(1) {
            return Err(ProtocolError::WindowExceeded(call));
        }
        if h.seq != c.recv_seq {
            return Err(ProtocolError::SequenceGap {
                call,
                expected: c.recv_seq,
                got: h.seq,
            });
        }
        c.recv_seq = c.recv_seq.wrapping_add(packed.max(1));
        c.recv_window -= packed.max(1);
        Ok(Event::StreamMessage {
            call,
            seq: h.seq,
            bulk: h.bulk,
            packed,
        })
    }

    fn recv_window_update(
        &mut self,
        i: usize,
        call: CallId,
        grant: u32,
    ) -> Result<Event, ProtocolError> {
        let max = self.cfg.stream_window_max;
        let c = &mut self.calls[i];
        let window = u64::from(c.send_window) + u64::from(grant);
        if window > u64::from(max) {
            return Err(ProtocolError::WindowOverflow { call, window, max });
        }
        c.send_window = window as u32;
        Ok(Event::WindowUpdate { call, grant })
    }

    /// Client: Response, Status, StreamMessage, WindowUpdate.
    fn client_frame(&mut self, h: &FrameHeader) -> Result<Event, ProtocolError> {
        use FrameKind as K;
        let call = self.peer_id(h.call_id)?;
        let kind = h.kind;
        let i = call.slot() as usize;
        let c = self.calls[i];
        let stale = Event::Stale {
            call,
            kind,
            bulk: h.bulk,
        };
        if c.id != call.0 {
            // Generation 0 in the entry: the slot was never used.
            if CallId(c.id).generation() == 0 {
                return Err(ProtocolError::UnknownCall { call, kind });
            }
            return Ok(stale);
        }
        match c.state {
            State::Free | State::Cancelled | State::Expired => return Ok(stale),
            State::Idle => return Err(ProtocolError::UnknownCall { call, kind }),
            State::Done => return Err(ProtocolError::AfterEnd { call, kind }),
            State::Open => {}
            State::Closed => {
                debug_assert!(false, "Closed is a server state");
                return Ok(stale);
            }
        }
        let unexpected = |why| Err(ProtocolError::Unexpected { call, kind, why });
        match kind {
            K::Response => {
                if c.kind.server_streams() {
                    return unexpected("a server-streaming call ends with Status, not Response");
                }
                self.check_bulk(call, h)?;
                let written = h.flags.contains(FrameFlags::WRITTEN);
                if written {
                    if c.landing_len == 0 {
                        return unexpected("written into a landing zone the request did not offer");
                    }
                    if h.frame_len() > c.landing_len {
                        return unexpected("written frame larger than the landing zone");
                    }
                }
                self.end_client_call(i);
                Ok(Event::Response {
                    call,
                    bulk: h.bulk,
                    written,
                })
            }
            K::Status => {
                self.end_client_call(i);
                Ok(Event::Status {
                    call,
                    code: h.aux.min(255) as u8,
                })
            }
            K::StreamMessage => {
                if !c.kind.server_streams() {
                    return unexpected("stream message on a call without a server stream");
                }
                self.recv_stream_message(i, call, h)
            }
            K::WindowUpdate => {
                if !c.kind.client_streams() {
                    return unexpected("window update on a call without a client stream");
                }
                self.recv_window_update(i, call, h.aux)
            }
            _ => Err(ProtocolError::WrongDirection {
                kind,
                role: self.role,
            }),
        }
    }

    fn end_client_call(&mut self, i: usize) {
        let c = &mut self.calls[i];
        c.state = State::Done;
        c.remote_closed = true;
        self.deadlines.remove(i as u32);
    }

    /// Server: a Request.
    fn server_request(&mut self, h: &FrameHeader, now: u64) -> Result<Event, ProtocolError> {
        let call = self.peer_id(h.call_id)?;
        let i = call.slot() as usize;
        let old = self.calls[i];
        let replaced = if old.state == State::Free {
            None
        } else if old.id == call.0 {
            return Err(ProtocolError::DuplicateRequest(call));
        } else {
            Some(CallId(old.id))
        };
        let end_stream = h.flags.contains(FrameFlags::END_STREAM);
        let server_stream = h.flags.contains(FrameFlags::SERVER_STREAM);
        let kind = match (end_stream, server_stream) {
            (true, false) => CallKind::Unary,
            (true, true) => CallKind::ServerStreaming,
            (false, false) => CallKind::ClientStreaming,
            (false, true) => CallKind::Streaming,
        };
        self.check_bulk(call, h)?;
        if h.landing.is_some() && server_stream {
            return Err(ProtocolError::Unexpected {
                call,
                kind: FrameKind::Request,
                why: "landing zone on a server-streaming call",
            });
        }
        if h.aux == 0 {
            return Err(ProtocolError::Unexpected {
                call,
                kind: FrameKind::Request,
                why: "method id 0 is reserved",
            });
        }
        let deadline = h.deadline.map(|t| now.saturating_add(t));
        if old.state != State::Free {
            self.deadlines.remove(i as u32);
        } else {
            self.live += 1;
        }
        self.calls[i] = Call {
            id: call.0,
            state: State::Open,
            kind,
            method: h.aux,
            sent: true,
            remote_closed: end_stream,
            deadline,
            landing_len: h.landing.map_or(0, |l| l.len),
            pending: match h.bulk {
                Some(b) if h.flags.contains(FrameFlags::BULK_PENDING) => b.len,
                _ => 0,
            },
            send_window: self.cfg.stream_window,
            recv_window: self.cfg.stream_window,
            ..Call::EMPTY
        };
        if let Some(d) = deadline {
            self.deadlines.insert(i as u32, d);
        }
        Ok(Event::Request {
            pending: h.flags.contains(FrameFlags::BULK_PENDING),
            call,
            method_id: h.aux,
            kind,
            deadline_at: deadline,
            bulk: h.bulk,
            bulk_more: h.bulk_more,
            landing: h.landing,
            replaced,
        })
    }

    /// Server: StreamMessage, EndOfStream, Cancel, WindowUpdate, BulkReady.
    fn server_frame(&mut self, h: &FrameHeader) -> Result<Event, ProtocolError> {
        use FrameKind as K;
        let call = self.peer_id(h.call_id)?;
        let kind = h.kind;
        let i = call.slot() as usize;
        let c = self.calls[i];
        if c.id != call.0 {
            // An older call of the slot (or a newer one never requested; with 16-bit
            // generations the two cannot be told apart): nothing to deliver.
            return Ok(Event::Stale {
                call,
                kind,
                bulk: h.bulk,
            });
        }
        match c.state {
            State::Free | State::Closed | State::Expired => {
                return Ok(Event::Stale {
                    call,
                    kind,
                    bulk: h.bulk,
                });
            }
            State::Cancelled => return Err(ProtocolError::AfterEnd { call, kind }),
            State::Open => {}
            State::Idle | State::Done => {
                debug_assert!(false, "client states on a server");
                return Err(ProtocolError::AfterEnd { call, kind });
            }
        }
        let unexpected = |why| Err(ProtocolError::Unexpected { call, kind, why });
        match kind {
            K::Cancel => {
                self.calls[i].state = State::Cancelled;
                self.deadlines.remove(i as u32);
                Ok(Event::Cancel { call })
            }
            K::StreamMessage => {
                if !c.kind.client_streams() {
                    return unexpected("stream message on a call without a client stream");
                }
                if c.remote_closed {
                    return unexpected("stream message after EndOfStream");
                }
                self.recv_stream_message(i, call, h)
            }
            K::EndOfStream => {
                if !c.kind.client_streams() {
                    return unexpected("EndOfStream on a call without a client stream");
                }
                if c.remote_closed {
                    return unexpected("second EndOfStream");
                }
                if h.seq != c.recv_seq {
                    return Err(ProtocolError::SequenceGap {
                        call,
                        expected: c.recv_seq,
                        got: h.seq,
                    });
                }
                self.calls[i].remote_closed = true;
                Ok(Event::EndOfStream { call })
            }
            K::WindowUpdate => {
                if !c.kind.server_streams() {
                    return unexpected("window update on a call without a server stream");
                }
                self.recv_window_update(i, call, h.aux)
            }
            K::BulkReady => {
                let ready = u64::from(h.aux) | u64::from(h.seq) << 32;
                if c.pending == 0 {
                    return unexpected("BulkReady for a call whose payload is not pending");
                }
                if ready <= c.ready {
                    return unexpected("BulkReady that does not grow");
                }
                if ready > c.pending {
                    return unexpected("BulkReady beyond the payload's length");
                }
                self.calls[i].ready = ready;
                Ok(Event::BulkReady { call, ready })
            }
            _ => Err(ProtocolError::WrongDirection {
                kind,
                role: self.role,
            }),
        }
    }

    /// Checks every internal invariant (tests and fuzzing): credits within bounds and
    /// conserved, the deadlines consistent with the call states, the free list and the
    /// live count exact, windows within bounds.
    pub(crate) fn check_invariants(&self) -> Result<(), &'static str> {
        if self.send_credits > self.cfg.max_send_credits {
            return Err("send credits above the most the peer grants");
        }
        if u64::from(self.peer_credits) + u64::from(self.unreposted) + u64::from(self.owed)
            != u64::from(self.window)
        {
            return Err("receive slots not conserved (peer credits + unreposted + owed)");
        }
        if self.window > self.cfg.recv_max || self.window < self.cfg.reserved_credits + 2 {
            return Err("window outside reserved_credits + 2 ..= recv_max");
        }
        if self.role == Role::Client && self.reclaiming
            || self.role == Role::Server && self.surrender.is_some()
        {
            return Err("reclaim state on the wrong role");
        }
        self.deadlines.check()?;
        let mut live = 0;
        let mut timed = 0;
        for c in self.calls.iter() {
            if c.state != State::Free {
                live += 1;
            }
            let pending = match self.role {
                Role::Client => matches!(c.state, State::Idle | State::Open),
                Role::Server => c.state == State::Open,
            };
            if pending && c.deadline.is_some() {
                timed += 1;
            }
            if c.send_window > self.cfg.stream_window_max
                || c.recv_window > self.cfg.stream_window_max
            {
                return Err("stream window above the configured maximum");
            }
        }
        if timed != self.deadlines.len() {
            return Err("the deadlines do not hold exactly the pending calls with deadlines");
        }
        if live != self.live {
            return Err("live call count out of sync");
        }
        if self.role == Role::Client {
            if self.free_len + live as usize != self.table {
                return Err("free list and live calls do not cover the table");
            }
            for &s in self.free.get(..self.free_len).unwrap_or(&[]) {
                if s as usize >= self.table {
                    return Err("free list holds a slot beyond the table");
                }
                // Entries not made yet are free.
                if self
                    .calls
                    .get(s as usize)
                    .is_some_and(|c| c.state != State::Free)
                {
                    return Err("free list holds a used slot");
                }
            }
        }
        Ok(())
    }
}
