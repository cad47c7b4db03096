//! Transport errors: failures to set up or keep a connection, as opposed to a call's
//! [`Status`](crate::Status). Every error says what was being done and why it failed.

use std::fmt;

use crate::verbs::VerbsError;

/// What kind of transport failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TransportErrorKind {
    /// The address could not be parsed or resolved.
    InvalidAddress,
    /// TCP connect or accept failed.
    Connect,
    /// The bootstrap handshake failed (garbage, wrong version, bad token, bad geometry).
    Handshake,
    /// A verb failed (see the source).
    Verbs,
    /// An I/O error.
    Io,
    /// The configuration is inconsistent.
    Config,
    /// The peer went away.
    Disconnected,
}

/// A transport error.
#[derive(Debug)]
pub struct Error {
    kind: TransportErrorKind,
    /// The status a call failing with this error ends with, when the peer said (a refusal).
    code: Option<crate::Code>,
    context: String,
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl Error {
    /// An error of `kind` with a message saying what failed.
    pub fn new(kind: TransportErrorKind, context: impl Into<String>) -> Error {
        Error {
            kind,
            code: None,
            context: context.into(),
            source: None,
        }
    }

    /// This error, ending a call with `code` (what the server's refusal said).
    pub(crate) fn with_code(mut self, code: crate::Code) -> Error {
        self.code = Some(code);
        self
    }

    /// The status code a call failing with this error ends with: what the server's refusal
    /// said, else one that follows from the kind (`INVALID_ARGUMENT` for a bad address or
    /// configuration, `UNAVAILABLE` otherwise).
    pub fn code(&self) -> crate::Code {
        self.code.unwrap_or(match self.kind {
            TransportErrorKind::InvalidAddress | TransportErrorKind::Config => {
                crate::Code::InvalidArgument
            }
            _ => crate::Code::Unavailable,
        })
    }

    /// An error of `kind` caused by `source`.
    pub fn with_source(
        kind: TransportErrorKind,
        context: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Error {
        Error {
            kind,
            code: None,
            context: context.into(),
            source: Some(Box::new(source)),
        }
    }

    /// The kind.
    pub fn kind(&self) -> TransportErrorKind {
        self.kind
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.context)?;
        if let Some(s) = &self.source {
            write!(f, ": {s}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<VerbsError> for Error {
    fn from(e: VerbsError) -> Error {
        Error::with_source(TransportErrorKind::Verbs, "RDMA verbs error", e)
    }
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Error {
        Error::with_source(TransportErrorKind::Io, "I/O error", e)
    }
}

impl From<Error> for crate::Status {
    fn from(e: Error) -> crate::Status {
        crate::Status::new(e.code(), e.to_string())
    }
}
