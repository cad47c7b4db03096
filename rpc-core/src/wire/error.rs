//! The errors of the protocol core, in layers: [`WireError`] (bytes that are not a valid frame,
//! or a bad configuration), [`ProtocolError`] (a valid frame the peer was not allowed to send:
//! the runtime closes the connection), [`StartError`] and [`SendError`] (what the local side
//! asked for cannot be done now, or is a bug).

use std::fmt;

use super::conn::{CallId, Role};
use super::frame::FrameKind;

/// Bytes that are not a valid frame, a buffer too small to encode into, or a bad [`Config`].
///
/// [`Config`]: super::Config
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WireError {
    /// The buffer ends before the frame does.
    Truncated {
        /// Bytes the frame needs (header, extensions, metadata, payload read so far).
        need: usize,
        /// Bytes the buffer has.
        have: usize,
    },
    /// The frame's version is not [`WIRE_VERSION`](super::WIRE_VERSION).
    BadVersion(u8),
    /// The kind byte names no [`FrameKind`].
    UnknownKind(u8),
    /// Flag bits this version does not know (the unknown bits).
    UnknownFlags(u16),
    /// Flags, kind and fields contradict each other; says which rule.
    Inconsistent(&'static str),
    /// The output buffer is too small for the header.
    BufferTooSmall {
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        have: usize,
    },
    /// A [`Config`](super::Config) value is out of range; says which.
    InvalidConfig(&'static str),
    /// A frame with [`FrameFlags::MORE`](super::FrameFlags::MORE) ends its SEND: the frame
    /// it announces is missing.
    BatchTruncated {
        /// Offset in the SEND where the next frame should start (its byte length).
        at: usize,
    },
    /// Bytes follow the last frame of a SEND (one without
    /// [`FrameFlags::MORE`](super::FrameFlags::MORE)).
    BatchTrailing {
        /// Where the last frame ends.
        end: usize,
        /// Bytes the SEND delivered.
        len: usize,
    },
    /// The payload of a [`FrameFlags::PACKED`](super::FrameFlags::PACKED) frame is not
    /// exactly its messages.
    Packed {
        /// The message (from 0) where the payload went wrong.
        index: u32,
        /// What is wrong.
        why: &'static str,
    },
}

impl fmt::Display for WireError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            WireError::Truncated { need, have } => write!(
                f,
                "decode frame: truncated, the frame needs {need} bytes but the buffer has {have} \
                 (a short receive, or lengths in the header that lie)"
            ),
            WireError::BadVersion(v) => write!(
                f,
                "decode frame: wire version {v}, this side speaks {} (peer built from another \
                 release?)",
                super::WIRE_VERSION
            ),
            WireError::UnknownKind(k) => write!(f, "decode frame: unknown frame kind {k}"),
            WireError::UnknownFlags(b) => write!(f, "decode frame: unknown flag bits {b:#06x}"),
            WireError::Inconsistent(why) => write!(f, "invalid frame: {why}"),
            WireError::BufferTooSmall { need, have } => write!(
                f,
                "encode frame: the header needs {need} bytes, the output buffer has {have}"
            ),
            WireError::InvalidConfig(why) => write!(f, "invalid wire config: {why}"),
            WireError::BatchTruncated { at } => write!(
                f,
                "decode batch: the frame ending at byte {at} says another follows (MORE), but \
                 the SEND ends there"
            ),
            WireError::BatchTrailing { end, len } => write!(
                f,
                "decode batch: {} bytes after the last frame (it ends at byte {end} without \
                 MORE; the SEND has {len})",
                len.saturating_sub(*end)
            ),
            WireError::Packed { index, why } => write!(
                f,
                "decode packed stream frame: message {index}: {why} (a sender that broke the \
                 packing rules, or a corrupted payload)"
            ),
        }
    }
}

impl std::error::Error for WireError {}

/// Why a call could not be started: back-pressure, not failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartError {
    /// `max_calls` calls are in flight: wait for one to finish.
    TooManyCalls,
    /// The server sent GoAway: start new calls on another connection.
    GoingAway,
    /// Only a client starts calls.
    NotClient,
    /// Method id 0 is reserved.
    BadMethod,
}

impl fmt::Display for StartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StartError::TooManyCalls => {
                "start call: max_calls calls are in flight on this connection (wait for one)"
            }
            StartError::GoingAway => {
                "start call: the server is draining (GoAway); use another connection"
            }
            StartError::NotClient => {
                "start call: only the client side of a connection starts calls"
            }
            StartError::BadMethod => "start call: method id 0 is reserved",
        })
    }
}

impl std::error::Error for StartError {}

/// Why a frame could not be built. [`SendError::NoCredit`] and [`SendError::Window`] are
/// back-pressure (retry when credits or a window update arrive); [`SendError::Gone`] and
/// [`SendError::Expired`] mean the call ended meanwhile (drop the frame, complete the call);
/// the rest are bugs in the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendError {
    /// Not enough send credits for this class of frame: wait for the peer's credits.
    NoCredit,
    /// The stream's window is closed: wait for the peer's WindowUpdate.
    Window,
    /// The call ended (cancelled, expired, replaced, or finished) before this frame.
    Gone,
    /// The call's deadline passed before its request could be sent.
    Expired,
    /// The call id is not one of this side's live calls.
    BadCall(CallId),
    /// The call is in a state that forbids this frame; says why.
    BadState(&'static str),
    /// An argument is out of range; says which.
    Invalid(&'static str),
}

impl fmt::Display for SendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SendError::NoCredit => f.write_str(
                "build frame: no send credit (the peer has no free receive slot for us yet)",
            ),
            SendError::Window => {
                f.write_str("build frame: stream window closed (the peer has not consumed yet)")
            }
            SendError::Gone => f.write_str("build frame: the call already ended"),
            SendError::Expired => f.write_str("build frame: the call's deadline already passed"),
            SendError::BadCall(c) => write!(f, "build frame: {c} is not a live call of ours"),
            SendError::BadState(why) => write!(f, "build frame: {why}"),
            SendError::Invalid(why) => write!(f, "build frame: {why}"),
        }
    }
}

impl std::error::Error for SendError {}

/// A frame the peer was not allowed to send. The runtime closes the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    /// A frame arrived though, by our count, the peer had no receive credit for it.
    NoCredit,
    /// The peer returned more credits than our send ring can ever have.
    CreditOverflow {
        /// Our credits after adding the frame's.
        credits: u32,
        /// The peer's receive ring depth.
        max: u32,
    },
    /// A frame this role never receives (a Request on a client, a Response on a server, ...).
    WrongDirection {
        /// The frame kind.
        kind: FrameKind,
        /// Our role.
        role: Role,
    },
    /// A call id outside the call table, or with generation 0.
    BadCallId(u32),
    /// A frame for a call that was never started.
    UnknownCall {
        /// The call.
        call: CallId,
        /// The frame kind.
        kind: FrameKind,
    },
    /// A Request for a call id that is already open.
    DuplicateRequest(CallId),
    /// A frame after the call's end that the peer knew about (after its final frame, or
    /// after its Cancel).
    AfterEnd {
        /// The call.
        call: CallId,
        /// The frame kind.
        kind: FrameKind,
    },
    /// A frame the call's kind or state does not allow; says why.
    Unexpected {
        /// The call.
        call: CallId,
        /// The frame kind.
        kind: FrameKind,
        /// The rule.
        why: &'static str,
    },
    /// A stream message out of sequence.
    SequenceGap {
        /// The call.
        call: CallId,
        /// Expected sequence number.
        expected: u32,
        /// Received sequence number.
        got: u32,
    },
    /// A stream message beyond the window we granted.
    WindowExceeded(CallId),
    /// A window grant beyond the configured stream window.
    WindowOverflow {
        /// The call.
        call: CallId,
        /// Our window after the grant.
        window: u64,
        /// The configured maximum.
        max: u32,
    },
    /// A credit reclaim the protocol does not allow ([`FrameFlags::RECLAIM`]); says why.
    ///
    /// [`FrameFlags::RECLAIM`]: super::FrameFlags::RECLAIM
    Reclaim(&'static str),
    /// A message larger than `max_message`.
    TooLarge {
        /// The call.
        call: CallId,
        /// Its length.
        len: u64,
        /// The limit.
        max: u64,
    },
}

impl fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtocolError::NoCredit => f.write_str(
                "protocol violation: the peer sent a frame without a receive credit (it ignores \
                 flow control; on hardware this would be an RNR error)",
            ),
            ProtocolError::CreditOverflow { credits, max } => write!(
                f,
                "protocol violation: the peer's credits bring ours to {credits}, above its \
                 receive ring depth {max} (ring geometry mismatch in the handshake?)"
            ),
            ProtocolError::WrongDirection { kind, role } => write!(
                f,
                "protocol violation: a {role:?} never receives {kind} frames (peer has the same \
                 role?)"
            ),
            ProtocolError::BadCallId(id) => write!(
                f,
                "protocol violation: call id {id:#010x} is outside the call table (call table \
                 sizes disagree?)"
            ),
            ProtocolError::UnknownCall { call, kind } => {
                write!(
                    f,
                    "protocol violation: {kind} for {call}, which was never started"
                )
            }
            ProtocolError::DuplicateRequest(call) => {
                write!(f, "protocol violation: second Request for open {call}")
            }
            ProtocolError::AfterEnd { call, kind } => write!(
                f,
                "protocol violation: {kind} for {call} after the peer ended it"
            ),
            ProtocolError::Unexpected { call, kind, why } => {
                write!(f, "protocol violation: {kind} for {call}: {why}")
            }
            ProtocolError::SequenceGap {
                call,
                expected,
                got,
            } => write!(
                f,
                "protocol violation: stream message {got} for {call}, expected {expected} (lost \
                 or reordered frame)"
            ),
            ProtocolError::WindowExceeded(call) => write!(
                f,
                "protocol violation: stream message for {call} beyond the window we granted"
            ),
            ProtocolError::WindowOverflow { call, window, max } => write!(
                f,
                "protocol violation: window update for {call} opens the window to {window}, \
                 above the largest stream window {max} (stream_window_max differs between the \
                 ends?)"
            ),
            ProtocolError::Reclaim(why) => {
                write!(f, "protocol violation: credit reclaim: {why}")
            }
            ProtocolError::TooLarge { call, len, max } => write!(
                f,
                "protocol violation: message of {len} bytes for {call}, above max_message {max}"
            ),
        }
    }
}

impl std::error::Error for ProtocolError {}
