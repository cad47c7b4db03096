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

    /// The cause this error was made with (shown in its `Display`, so not its `source()`).
    pub(crate) fn cause(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.source.as_deref()
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
    /// The cause's own cause, if any. The cause itself is part of this error's `Display`
    /// ("context: cause", what `{e}` and a call's `Status` show), so it is not returned here
    /// as well: reporters that print the chain (anyhow's `{:#}`, `tracing`'s error fields)
    /// printed it twice.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source.as_deref().and_then(|e| e.source())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::Verb;

    /// The whole chain, as reporters print it: each error's `Display`, then its source's.
    fn chain(e: &dyn std::error::Error) -> String {
        let mut out = e.to_string();
        let mut next = e.source();
        while let Some(s) = next {
            out.push_str(": ");
            out.push_str(&s.to_string());
            next = s.source();
        }
        out
    }

    #[test]
    fn a_cause_is_shown_once_whether_printed_alone_or_as_a_chain() {
        let verbs = VerbsError::from_errno(Verb::AllocMr, libc::EMFILE, "cannot create a memfd");
        let e = Error::from(verbs);
        let shown = e.to_string();
        assert!(shown.starts_with("RDMA verbs error: alloc_mr"), "{shown}");
        assert_eq!(shown.matches("cannot create a memfd").count(), 1, "{shown}");
        assert_eq!(chain(&e), shown, "nothing printed twice down the chain");

        let io = std::io::Error::new(std::io::ErrorKind::BrokenPipe, "peer went away");
        let e = Error::with_source(TransportErrorKind::Connect, "sending handshake", io);
        assert_eq!(e.to_string(), "sending handshake: peer went away");
        assert_eq!(chain(&e), e.to_string());
    }

    /// A cause's own cause still reaches chain reporters (it is in no `Display` above it).
    #[test]
    fn a_deeper_cause_stays_in_the_chain() {
        #[derive(Debug)]
        struct Outer(std::io::Error);
        impl fmt::Display for Outer {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("outer")
            }
        }
        impl std::error::Error for Outer {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let e = Error::with_source(
            TransportErrorKind::Io,
            "reading",
            Outer(std::io::Error::other("inner")),
        );
        assert_eq!(chain(&e), "reading: outer: inner");
    }
}
