//! Method descriptors: what generated code tells the runtime about each rpc.

/// The four call kinds of gRPC.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallKind {
    /// One request, one response.
    Unary,
    /// One request, a stream of responses.
    ServerStreaming,
    /// A stream of requests, one response.
    ClientStreaming,
    /// Streams both ways.
    Streaming,
}

impl CallKind {
    /// Whether the client sends a stream.
    pub const fn client_streams(self) -> bool {
        matches!(self, CallKind::ClientStreaming | CallKind::Streaming)
    }

    /// Whether the server sends a stream.
    pub const fn server_streams(self) -> bool {
        matches!(self, CallKind::ServerStreaming | CallKind::Streaming)
    }
}

/// What running a method twice does: protobuf's `MethodOptions.idempotency_level`
/// (`option idempotency_level = IDEMPOTENT;` in a `.proto`, `#[rpc(idempotent)]` in
/// `#[service]`). A client retries a call that may have reached a handler only when its
/// method says it is safe to ([`Idempotency::is_retry_safe`]; see
/// [`RetryPolicy`](crate::RetryPolicy)).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Idempotency {
    /// Nothing is declared: running the method twice may do something twice (never retried
    /// once it may have executed).
    #[default]
    Unknown,
    /// Running it twice has the effect of running it once (`IDEMPOTENT`).
    Idempotent,
    /// It has no side effects at all (`NO_SIDE_EFFECTS`, e.g. a read).
    NoSideEffects,
}

impl Idempotency {
    /// Whether a call that may have executed can be sent again (`Idempotent` or
    /// `NoSideEffects`).
    pub const fn is_retry_safe(self) -> bool {
        !matches!(self, Idempotency::Unknown)
    }
}

/// A method of a service: its path (`/package.Service/Method`), the stable 32-bit id derived
/// from the path that travels in every frame, its call kind and its declared idempotency.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MethodDesc {
    /// Stable id: [`method_id`] of `path`.
    pub id: u32,
    /// `/package.Service/Method`.
    pub path: &'static str,
    /// Call kind.
    pub kind: CallKind,
    /// What running it twice does ([`Idempotency::Unknown`] unless declared): set with
    /// [`MethodDesc::with_idempotency`]. Local only: it does not travel on the wire.
    pub idempotency: Idempotency,
}

impl MethodDesc {
    /// The descriptor of `path` (of unknown idempotency).
    pub const fn new(path: &'static str, kind: CallKind) -> MethodDesc {
        MethodDesc {
            id: method_id(path),
            path,
            kind,
            idempotency: Idempotency::Unknown,
        }
    }

    /// This descriptor with its idempotency declared (usable in a `const`).
    #[must_use]
    pub const fn with_idempotency(mut self, idempotency: Idempotency) -> MethodDesc {
        self.idempotency = idempotency;
        self
    }

    /// The service part of the path (`package.Service`).
    pub fn service(&self) -> &'static str {
        let p = self.path.strip_prefix('/').unwrap_or(self.path);
        p.split('/').next().unwrap_or(p)
    }

    /// The method part of the path (`Method`).
    pub fn method(&self) -> &'static str {
        self.path.rsplit('/').next().unwrap_or(self.path)
    }
}

/// The stable id of a method path: 32-bit FNV-1a of the UTF-8 bytes of `/package.Service/Method`.
/// 0 is reserved (it marks frames that belong to no method) and maps to 1. A server refuses two
/// methods with the same id.
pub const fn method_id(path: &str) -> u32 {
    let b = path.as_bytes();
    let mut h: u32 = 0x811c_9dc5;
    let mut i = 0;
    while i < b.len() {
        h ^= b[i] as u32;
        h = h.wrapping_mul(0x0100_0193);
        i += 1;
    }
    if h == 0 { 1 } else { h }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_stable_fnv1a() {
        // Reference values of 32-bit FNV-1a.
        assert_eq!(method_id("a"), 0xe40c_292c);
        assert_eq!(method_id("foobar"), 0xbf9c_f968);
        const D: MethodDesc = MethodDesc::new("/helloworld.Greeter/SayHello", CallKind::Unary);
        assert_eq!(D.service(), "helloworld.Greeter");
        assert_eq!(D.method(), "SayHello");
        assert_ne!(D.id, 0);
        assert_eq!(D.idempotency, Idempotency::Unknown);
        const E: MethodDesc =
            MethodDesc::new("/a.B/C", CallKind::Unary).with_idempotency(Idempotency::NoSideEffects);
        assert!(E.idempotency.is_retry_safe());
        assert!(!Idempotency::Unknown.is_retry_safe());
        assert_eq!(E.id, method_id("/a.B/C"));
    }
}
