//! The outcome of a call as the remote side (or the runtime on its behalf) reports it: gRPC's
//! status codes with a message. Kept apart from transport errors ([`crate::Error`]), as tonic
//! does.

use std::fmt;

/// gRPC status codes, same numbers as `google.rpc.Code`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum Code {
    /// Not an error.
    Ok = 0,
    /// The operation was cancelled, typically by the caller.
    Cancelled = 1,
    /// Unknown error.
    Unknown = 2,
    /// The client specified an invalid argument.
    InvalidArgument = 3,
    /// The deadline expired before the operation could complete.
    DeadlineExceeded = 4,
    /// Some requested entity was not found.
    NotFound = 5,
    /// The entity that a client attempted to create already exists.
    AlreadyExists = 6,
    /// The caller does not have permission.
    PermissionDenied = 7,
    /// Some resource has been exhausted (credits, memory, message size).
    ResourceExhausted = 8,
    /// The system is not in a state required for the operation.
    FailedPrecondition = 9,
    /// The operation was aborted.
    Aborted = 10,
    /// The operation was attempted past the valid range.
    OutOfRange = 11,
    /// The operation is not implemented or not supported (unknown method).
    Unimplemented = 12,
    /// Internal error: an invariant expected by the system is broken.
    Internal = 13,
    /// The service is currently unavailable (peer gone, connection lost).
    Unavailable = 14,
    /// Unrecoverable data loss or corruption.
    DataLoss = 15,
    /// The request does not have valid authentication credentials.
    Unauthenticated = 16,
}

impl Code {
    /// Code from its number; unknown numbers map to [`Code::Unknown`].
    pub const fn from_u8(v: u8) -> Code {
        match v {
            0 => Code::Ok,
            1 => Code::Cancelled,
            2 => Code::Unknown,
            3 => Code::InvalidArgument,
            4 => Code::DeadlineExceeded,
            5 => Code::NotFound,
            6 => Code::AlreadyExists,
            7 => Code::PermissionDenied,
            8 => Code::ResourceExhausted,
            9 => Code::FailedPrecondition,
            10 => Code::Aborted,
            11 => Code::OutOfRange,
            12 => Code::Unimplemented,
            13 => Code::Internal,
            14 => Code::Unavailable,
            15 => Code::DataLoss,
            16 => Code::Unauthenticated,
            _ => Code::Unknown,
        }
    }

    /// The canonical upper-case name (`DEADLINE_EXCEEDED`).
    pub const fn name(self) -> &'static str {
        match self {
            Code::Ok => "OK",
            Code::Cancelled => "CANCELLED",
            Code::Unknown => "UNKNOWN",
            Code::InvalidArgument => "INVALID_ARGUMENT",
            Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
            Code::NotFound => "NOT_FOUND",
            Code::AlreadyExists => "ALREADY_EXISTS",
            Code::PermissionDenied => "PERMISSION_DENIED",
            Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
            Code::FailedPrecondition => "FAILED_PRECONDITION",
            Code::Aborted => "ABORTED",
            Code::OutOfRange => "OUT_OF_RANGE",
            Code::Unimplemented => "UNIMPLEMENTED",
            Code::Internal => "INTERNAL",
            Code::Unavailable => "UNAVAILABLE",
            Code::DataLoss => "DATA_LOSS",
            Code::Unauthenticated => "UNAUTHENTICATED",
        }
    }
}

impl fmt::Display for Code {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Longest status message carried, in bytes (as long as the metadata budget,
/// [`crate::MAX_METADATA_LEN`]); a longer one is cut at a character boundary, and a frame too
/// small for it (a small slot geometry) cuts it further, also at a character.
pub const MAX_STATUS_MESSAGE_LEN: usize = crate::MAX_METADATA_LEN;

/// The longest prefix of `s` of at most `max` bytes that ends at a character boundary.
pub(crate) fn cut_at_char(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// The message of the runtime's `UNIMPLEMENTED` for a method the server does not serve; the
/// client replaces it with one naming the path it called ([`Status::for_method`]).
pub(crate) const UNKNOWN_METHOD: &str = "the server has no such method";

/// The metadata key of a status's details (gRPC's rich error model, `google.rpc.Status`).
pub const STATUS_DETAILS_KEY: &str = "grpc-status-details-bin";

/// The trailer by which a server's runtime says a call reached no handler (it drains: see
/// [`Status::is_not_executed`]). Reserved: the server strips it from every status and trailer
/// its handlers send, so a handler cannot pass on one it got from a call of its own (it ran);
/// a client honours it only on an `UNAVAILABLE` status with the value `1`, and removes it.
pub const NOT_EXECUTED_KEY: &str = "rpc-not-executed";

/// A call's outcome other than success: a [`Code`] and a message, plus optional metadata sent
/// back with it (trailers), binary details ([`Status::with_details`]) and, on the side that
/// made it, the error that caused it ([`Status::from_error`], not sent) and whether the call
/// provably reached no handler ([`Status::is_not_executed`], not sent as such).
#[derive(Clone)]
pub struct Status {
    code: Code,
    /// The call reached no handler (local: see [`Status::is_not_executed`]).
    not_executed: bool,
    message: String,
    metadata: crate::Metadata,
    source: Option<std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

/// Code, message and metadata (details included); the local `source` is not compared.
impl PartialEq for Status {
    fn eq(&self, other: &Status) -> bool {
        self.code == other.code && self.message == other.message && self.metadata == other.metadata
    }
}

impl Eq for Status {}

impl Status {
    /// A status with `code` and `message`.
    pub fn new(code: Code, message: impl Into<String>) -> Status {
        Status {
            code,
            not_executed: false,
            message: message.into(),
            metadata: crate::Metadata::new(),
            source: None,
        }
    }

    /// A status with binary `details` (an encoded `google.rpc.Status` in gRPC's rich error
    /// model), sent in the trailer [`STATUS_DETAILS_KEY`] as gRPC does. Details and the rest of
    /// the status's metadata share [`crate::MAX_METADATA_LEN`]: details that do not
    /// fit are left out, and the message says so.
    pub fn with_details(
        code: Code,
        message: impl Into<String>,
        details: impl Into<Vec<u8>>,
    ) -> Status {
        let mut st = Status::new(code, message);
        let details = details.into();
        let n = details.len();
        if st.metadata.insert_bin(STATUS_DETAILS_KEY, details).is_err() {
            st.message.push_str(&format!(
                " ({n} bytes of details left out: over the {}-byte metadata limit)",
                crate::MAX_METADATA_LEN
            ));
        }
        st
    }

    /// This status as the caller of `path` sees it: the runtime's unknown-method status
    /// names the path (a handler's own `UNIMPLEMENTED` is left as it is).
    pub(crate) fn for_method(self, path: &str) -> Status {
        if self.code == Code::Unimplemented && self.message == UNKNOWN_METHOD {
            let mut st = self;
            st.message = format!("unknown method {path}: {UNKNOWN_METHOD}");
            st
        } else {
            self
        }
    }

    /// The status's binary details (empty when it has none).
    pub fn details(&self) -> &[u8] {
        self.metadata.get(STATUS_DETAILS_KEY).unwrap_or(&[])
    }

    /// A status for an error of the handler's own: the error itself when it is a `Status`,
    /// else `UNKNOWN` with the error's text, keeping the error as [`std::error::Error::source`]
    /// (on this side only), as tonic's `Status::from_error`.
    pub fn from_error(err: Box<dyn std::error::Error + Send + Sync + 'static>) -> Status {
        match err.downcast::<Status>() {
            Ok(st) => *st,
            Err(err) => {
                let mut st = Status::new(Code::Unknown, err.to_string());
                st.source = Some(std::sync::Arc::from(err));
                st
            }
        }
    }

    /// Sets the error that caused this status (kept on this side, not sent).
    pub fn set_source(
        &mut self,
        source: std::sync::Arc<dyn std::error::Error + Send + Sync + 'static>,
    ) -> &mut Status {
        self.source = Some(source);
        self
    }

    /// Whether the call provably reached no handler, so sending it again cannot run anything
    /// twice: the client could not connect or finish the handshake, the connection was lost
    /// (or the server had said GoAway) before the request was posted, or the server refused
    /// it unexecuted because it drains (the trailer [`NOT_EXECUTED_KEY`], which only the
    /// server's runtime sets). Channels retry such calls on their own
    /// ([`RetryPolicy`](crate::RetryPolicy)); a caller with its own retry loop may retry them
    /// whatever the method. `false` whenever the call may have run, including a request lost
    /// with its connection after it was posted.
    ///
    /// The mark is local: a status a handler returns is sent without it, even when the
    /// handler got it from a call of its own.
    pub fn is_not_executed(&self) -> bool {
        self.not_executed
    }

    /// This status, marked as one of a call that reached no handler.
    pub(crate) fn not_executed(mut self) -> Status {
        self.not_executed = true;
        self
    }

    /// The status of a terminal frame from the server: the not-executed trailer (only on
    /// `UNAVAILABLE`, only with the value `1`) becomes the local mark and is removed.
    pub(crate) fn recognise_not_executed(mut self) -> Status {
        if self.metadata.get(NOT_EXECUTED_KEY).is_some() {
            let honoured =
                self.code == Code::Unavailable && self.metadata.get(NOT_EXECUTED_KEY) == Some(b"1");
            self.metadata.remove(NOT_EXECUTED_KEY);
            self.not_executed = honoured;
        }
        self
    }

    /// The code.
    pub fn code(&self) -> Code {
        self.code
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Metadata sent with the status (trailers).
    pub fn metadata(&self) -> &crate::Metadata {
        &self.metadata
    }

    /// Mutable metadata sent with the status.
    pub fn metadata_mut(&mut self) -> &mut crate::Metadata {
        &mut self.metadata
    }

    /// `CANCELLED`.
    pub fn cancelled(message: impl Into<String>) -> Status {
        Status::new(Code::Cancelled, message)
    }
    /// `UNKNOWN`.
    pub fn unknown(message: impl Into<String>) -> Status {
        Status::new(Code::Unknown, message)
    }
    /// `INVALID_ARGUMENT`.
    pub fn invalid_argument(message: impl Into<String>) -> Status {
        Status::new(Code::InvalidArgument, message)
    }
    /// `DEADLINE_EXCEEDED`.
    pub fn deadline_exceeded(message: impl Into<String>) -> Status {
        Status::new(Code::DeadlineExceeded, message)
    }
    /// `NOT_FOUND`.
    pub fn not_found(message: impl Into<String>) -> Status {
        Status::new(Code::NotFound, message)
    }
    /// `ALREADY_EXISTS`.
    pub fn already_exists(message: impl Into<String>) -> Status {
        Status::new(Code::AlreadyExists, message)
    }
    /// `PERMISSION_DENIED`.
    pub fn permission_denied(message: impl Into<String>) -> Status {
        Status::new(Code::PermissionDenied, message)
    }
    /// `RESOURCE_EXHAUSTED`.
    pub fn resource_exhausted(message: impl Into<String>) -> Status {
        Status::new(Code::ResourceExhausted, message)
    }
    /// `FAILED_PRECONDITION`.
    pub fn failed_precondition(message: impl Into<String>) -> Status {
        Status::new(Code::FailedPrecondition, message)
    }
    /// `ABORTED`.
    pub fn aborted(message: impl Into<String>) -> Status {
        Status::new(Code::Aborted, message)
    }
    /// `OUT_OF_RANGE`.
    pub fn out_of_range(message: impl Into<String>) -> Status {
        Status::new(Code::OutOfRange, message)
    }
    /// `UNIMPLEMENTED`.
    pub fn unimplemented(message: impl Into<String>) -> Status {
        Status::new(Code::Unimplemented, message)
    }
    /// `INTERNAL`.
    pub fn internal(message: impl Into<String>) -> Status {
        Status::new(Code::Internal, message)
    }
    /// `UNAVAILABLE`.
    pub fn unavailable(message: impl Into<String>) -> Status {
        Status::new(Code::Unavailable, message)
    }
    /// `DATA_LOSS`.
    pub fn data_loss(message: impl Into<String>) -> Status {
        Status::new(Code::DataLoss, message)
    }
    /// `UNAUTHENTICATED`.
    pub fn unauthenticated(message: impl Into<String>) -> Status {
        Status::new(Code::Unauthenticated, message)
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Status");
        d.field("code", &self.code).field("message", &self.message);
        if !self.metadata.is_empty() {
            d.field("metadata", &self.metadata);
        }
        if self.not_executed {
            d.field("not_executed", &true);
        }
        d.finish()
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "status: {}, message: {:?}", self.code, self.message)
    }
}

impl std::error::Error for Status {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<std::io::Error> for Status {
    fn from(e: std::io::Error) -> Status {
        let code = match e.kind() {
            std::io::ErrorKind::NotFound => Code::NotFound,
            std::io::ErrorKind::PermissionDenied => Code::PermissionDenied,
            std::io::ErrorKind::TimedOut => Code::DeadlineExceeded,
            std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionReset
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::BrokenPipe
            | std::io::ErrorKind::NotConnected
            | std::io::ErrorKind::UnexpectedEof => Code::Unavailable,
            std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData => {
                Code::InvalidArgument
            }
            _ => Code::Unknown,
        };
        Status::new(code, e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_not_executed_trailer_is_honoured_only_as_the_runtime_sends_it() {
        let with = |code: Code, value: &str| {
            let mut st = Status::new(code, "m");
            st.metadata_mut().insert(NOT_EXECUTED_KEY, value).unwrap();
            st.metadata_mut().insert("other", "kept").unwrap();
            st.recognise_not_executed()
        };
        let st = with(Code::Unavailable, "1");
        assert!(st.is_not_executed());
        assert!(st.metadata().get(NOT_EXECUTED_KEY).is_none(), "removed");
        assert_eq!(st.metadata().get_str("other"), Some("kept"));
        // Another code or value: not honoured, and still removed.
        for st in [with(Code::Internal, "1"), with(Code::Unavailable, "yes")] {
            assert!(!st.is_not_executed(), "{st:?}");
            assert!(st.metadata().get(NOT_EXECUTED_KEY).is_none());
        }
        assert!(
            !Status::unavailable("x")
                .recognise_not_executed()
                .is_not_executed()
        );
        // The mark is local: not compared, not in the metadata.
        let marked = Status::unavailable("x").not_executed();
        assert!(marked.is_not_executed() && marked.metadata().is_empty());
        assert_eq!(marked, Status::unavailable("x"));
    }

    #[test]
    fn codes_round_trip_through_their_numbers() {
        for v in 0..=16u8 {
            assert_eq!(Code::from_u8(v) as u8, v);
        }
        assert_eq!(Code::from_u8(200), Code::Unknown);
    }

    #[test]
    fn details_travel_as_binary_metadata_and_sources_stay_local() {
        let st = Status::with_details(Code::InvalidArgument, "bad field", vec![0u8, 1, 255]);
        assert_eq!(st.details(), &[0u8, 1, 255][..]);
        assert_eq!(
            st.metadata().get(STATUS_DETAILS_KEY),
            Some(&[0u8, 1, 255][..])
        );
        assert!(Status::new(Code::Internal, "x").details().is_empty());
        let big = Status::with_details(Code::Internal, "x", vec![7u8; 10_000]);
        assert!(
            big.details().is_empty() && big.message().contains("left out"),
            "{big:?}"
        );

        let io = std::io::Error::other("disk on fire");
        let st = Status::from_error(Box::new(io));
        assert_eq!(st.code(), Code::Unknown);
        assert_eq!(st.message(), "disk on fire");
        let src = std::error::Error::source(&st).expect("the source is kept");
        assert_eq!(src.to_string(), "disk on fire");
        // A Status passes through unchanged; sources are not part of equality.
        let inner = Status::not_found("gone");
        assert_eq!(Status::from_error(Box::new(inner.clone())), inner);
    }

    #[test]
    fn messages_are_cut_at_characters() {
        let s = "✓".repeat(1002);
        assert_eq!(cut_at_char(&s, 1024).len(), 1023);
        assert_eq!(cut_at_char(&s, 1), "");
        assert_eq!(cut_at_char("abc", 10), "abc");
    }

    #[test]
    fn display_names_the_code_and_message() {
        let s = Status::not_found("no such key");
        assert_eq!(s.to_string(), "status: NOT_FOUND, message: \"no such key\"");
    }
}
