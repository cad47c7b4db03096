//! The bootstrap handshake over TCP: the client says [`Hello`] (its QP endpoint, ring geometry,
//! call table size, the optional shared-secret token, and the endpoints of the data QPs it
//! offers for several QPs per connection), the server answers [`Welcome`] (its endpoint,
//! geometry, call table size, the shard that took the connection and as many data QP
//! endpoints as it accepted, at most the client's) or a
//! [`Refusal`] saying why. The TCP connection then stays open as the liveness channel: when
//! either process dies its kernel closes the socket and the other side fails the connection's
//! calls with `UNAVAILABLE` at once.
//!
//! Every message is length-prefixed (`u32` LE) and at most [`MAX_MESSAGE`] bytes; the server
//! reads it under a timeout and validates every field before it allocates anything, so garbage,
//! a wrong version or a stranger without the token gets a clear error and no resources.

pub(crate) mod keepalive;

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::buf::Geometry;
use crate::verbs::Endpoint;
use crate::{Error, TransportErrorKind};

/// Magic at the start of every handshake message.
pub const MAGIC: [u8; 4] = *b"RRPC";
/// Handshake protocol version (2: data QP endpoints; 3: wire format 2, several frames per
/// SEND, so a peer of an older release is refused at the handshake with this version in the
/// message, before any frame; 4: wire format 3, a server's receive credits granted from a
/// pool shared by its connections, starting at `Welcome::initial_credits`; 5: stream windows
/// start at 16 messages and are opened to at most 256 by the receiver's grants, where a
/// version-4 peer refused any window above 16; 6: wire format 4, small stream messages packed
/// several to a frame; 7: wire format 5, request payloads READ while they are written; 8: the
/// client's receive window starts at `Hello::initial_credits` and grows by its grants).
pub const VERSION: u16 = 8;
/// Largest handshake message.
pub const MAX_MESSAGE: usize = 1024;
/// Most data QPs (besides the primary) one connection may have.
pub const MAX_DATA_QPS: usize = crate::verbs::MAX_QPS_PER_CONNECTION as usize - 1;
/// Longest shared-secret token.
pub const MAX_TOKEN: usize = 64;
/// How long a peer may take to send its handshake message.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

const KIND_HELLO: u8 = 1;
const KIND_WELCOME: u8 = 2;
const KIND_REFUSAL: u8 = 3;

/// The client's half of the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Provider tag (`Endpoint::PROVIDER_*`): both ends must use the same provider.
    pub provider: u8,
    /// The client QP's endpoint.
    pub endpoint: Endpoint,
    /// The client's slot geometry: `recv_slots` is the most receive credits the server may
    /// hold (the client's receive window grows to it, granting credits as its calls need).
    pub geometry: Geometry,
    /// The receive credits the server starts with (at most `geometry.recv_slots`).
    pub initial_credits: u32,
    /// Size of the client's call table.
    pub max_calls: u32,
    /// Shared-secret token (empty when none).
    pub token: Vec<u8>,
    /// Endpoints of the data QPs the client offers (at most `MAX_DATA_QPS`); the server
    /// connects to the first ones it accepts.
    pub data_endpoints: Vec<Endpoint>,
}

/// The server's acceptance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    /// The server QP's endpoint.
    pub endpoint: Endpoint,
    /// The server's slot geometry for this connection: `recv_slots` is the most receive
    /// credits the client may hold (granted from the shard's receive pool as it needs them).
    pub geometry: Geometry,
    /// The receive credits the client starts with (at most `geometry.recv_slots`).
    pub initial_credits: u32,
    /// Size of the server's call table for this connection.
    pub max_calls: u32,
    /// Shard that owns the connection.
    pub shard: u16,
    /// Number of shards.
    pub shards: u16,
    /// Endpoints of the server's data QPs, connected to the client's first ones in order (at
    /// most as many as offered; none for one QP per connection).
    pub data_endpoints: Vec<Endpoint>,
}

/// Why the server refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Reason, for the client's error message.
    pub reason: String,
    /// The status the client's attempt ends with (`UNAUTHENTICATED` for a bad token,
    /// `FAILED_PRECONDITION` for a configuration mismatch, `RESOURCE_EXHAUSTED` for a full
    /// shard, `UNAVAILABLE` for a server going away). Carried in the header's reserved byte,
    /// so a refusal without one (0) reads as `UNAVAILABLE`.
    pub code: crate::Code,
}

/// A decoded handshake message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Client hello.
    Hello(Hello),
    /// Server acceptance.
    Welcome(Welcome),
    /// Server refusal.
    Refusal(Refusal),
}

fn handshake_err(why: impl Into<String>) -> Error {
    Error::new(TransportErrorKind::Handshake, why)
}

struct W(Vec<u8>);

impl W {
    fn header(kind: u8) -> W {
        let mut v = Vec::with_capacity(128);
        v.extend_from_slice(&MAGIC);
        v.extend_from_slice(&VERSION.to_le_bytes());
        v.push(kind);
        v.push(0);
        W(v)
    }
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u16(&mut self, x: u16) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn u32(&mut self, x: u32) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn geometry(&mut self, g: &Geometry) {
        self.u32(g.slot_size);
        self.u32(g.send_slots);
        self.u32(g.recv_slots);
    }
    fn endpoints(&mut self, eps: &[Endpoint]) {
        let eps = &eps[..eps.len().min(MAX_DATA_QPS)];
        self.u8(eps.len() as u8);
        for e in eps {
            self.bytes(&e.to_bytes());
        }
    }
}

struct R<'a>(&'a [u8]);

impl<'a> R<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], Error> {
        if self.0.len() < n {
            return Err(handshake_err("handshake message truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, Error> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, Error> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    fn u32(&mut self) -> Result<u32, Error> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn geometry(&mut self) -> Result<Geometry, Error> {
        let g = Geometry {
            slot_size: self.u32()?,
            send_slots: self.u32()?,
            recv_slots: self.u32()?,
        };
        if !g.is_valid() {
            return Err(handshake_err(format!(
                "peer ring geometry out of range: {g:?}"
            )));
        }
        Ok(g)
    }
    fn endpoint(&mut self) -> Result<Endpoint, Error> {
        let b = self.take(Endpoint::ENCODED_LEN)?;
        Endpoint::from_bytes(b)
            .map_err(|e| Error::with_source(TransportErrorKind::Handshake, "bad peer endpoint", e))
    }
    fn endpoints(&mut self) -> Result<Vec<Endpoint>, Error> {
        let n = self.u8()? as usize;
        if n > MAX_DATA_QPS {
            return Err(handshake_err(format!(
                "peer offers {n} data QPs per connection, at most {MAX_DATA_QPS} are allowed"
            )));
        }
        (0..n).map(|_| self.endpoint()).collect()
    }
    /// The credits a peer starts us with: the reserve of two control credits plus two data
    /// credits, at least, and no more than its `recv_slots`.
    fn initial_credits(&mut self, geometry: &Geometry) -> Result<u32, Error> {
        let n = self.u32()?;
        if !(4..=geometry.recv_slots).contains(&n) {
            return Err(handshake_err(format!(
                "peer's initial credits {n} out of range (4..={})",
                geometry.recv_slots
            )));
        }
        Ok(n)
    }
}

impl Message {
    /// Encodes the message without its length prefix.
    pub fn encode(&self) -> Vec<u8> {
        match self {
            Message::Hello(h) => {
                let mut w = W::header(KIND_HELLO);
                w.u8(h.provider);
                w.u8(h.token.len().min(MAX_TOKEN) as u8);
                w.bytes(&h.token[..h.token.len().min(MAX_TOKEN)]);
                w.bytes(&h.endpoint.to_bytes());
                w.geometry(&h.geometry);
                w.u32(h.initial_credits);
                w.u32(h.max_calls);
                w.endpoints(&h.data_endpoints);
                w.0
            }
            Message::Welcome(m) => {
                let mut w = W::header(KIND_WELCOME);
                w.bytes(&m.endpoint.to_bytes());
                w.geometry(&m.geometry);
                w.u32(m.initial_credits);
                w.u32(m.max_calls);
                w.u16(m.shard);
                w.u16(m.shards);
                w.endpoints(&m.data_endpoints);
                w.0
            }
            Message::Refusal(r) => {
                let mut w = W::header(KIND_REFUSAL);
                w.0[7] = r.code as u8;
                let reason = crate::status::cut_at_char(&r.reason, MAX_MESSAGE - 16).as_bytes();
                w.u16(reason.len() as u16);
                w.bytes(reason);
                w.0
            }
        }
    }

    /// Decodes a message (without its length prefix).
    ///
    /// # Errors
    /// A handshake error saying what is wrong: not an rdma-rpc peer (magic), another protocol
    /// version, an unknown kind, a truncated or oversized message, out-of-range values.
    pub fn decode(buf: &[u8]) -> Result<Message, Error> {
        let mut r = R(buf);
        if r.take(4)? != MAGIC {
            return Err(handshake_err(
                "peer is not an rdma-rpc endpoint (bad handshake magic): is this the right port?",
            ));
        }
        let version = r.u16()?;
        if version != VERSION {
            return Err(handshake_err(format!(
                "handshake version {version} not supported (this side speaks {VERSION})"
            ))
            .with_code(crate::Code::FailedPrecondition));
        }
        let kind = r.u8()?;
        let reserved = r.u8()?;
        let msg = match kind {
            KIND_HELLO => {
                let provider = r.u8()?;
                let tlen = r.u8()? as usize;
                if tlen > MAX_TOKEN {
                    return Err(handshake_err("token longer than 64 bytes"));
                }
                let token = r.take(tlen)?.to_vec();
                let endpoint = r.endpoint()?;
                let geometry = r.geometry()?;
                let initial_credits = r.initial_credits(&geometry)?;
                let max_calls = r.u32()?;
                if max_calls == 0 || max_calls > Geometry::MAX_SLOTS {
                    return Err(handshake_err("peer call table size out of range"));
                }
                let data_endpoints = r.endpoints()?;
                Message::Hello(Hello {
                    provider,
                    endpoint,
                    geometry,
                    initial_credits,
                    max_calls,
                    token,
                    data_endpoints,
                })
            }
            KIND_WELCOME => {
                let endpoint = r.endpoint()?;
                let geometry = r.geometry()?;
                let initial_credits = r.initial_credits(&geometry)?;
                let max_calls = r.u32()?;
                if max_calls == 0 || max_calls > Geometry::MAX_SLOTS {
                    return Err(handshake_err("peer call table size out of range"));
                }
                let shard = r.u16()?;
                let shards = r.u16()?;
                if shards == 0 || shard >= shards {
                    return Err(handshake_err("peer shard index out of range"));
                }
                let data_endpoints = r.endpoints()?;
                Message::Welcome(Welcome {
                    endpoint,
                    geometry,
                    initial_credits,
                    max_calls,
                    shard,
                    shards,
                    data_endpoints,
                })
            }
            KIND_REFUSAL => {
                let n = r.u16()? as usize;
                let reason = String::from_utf8_lossy(r.take(n)?).into_owned();
                let code = match crate::Code::from_u8(reserved) {
                    crate::Code::Ok => crate::Code::Unavailable,
                    c => c,
                };
                Message::Refusal(Refusal { reason, code })
            }
            k => return Err(handshake_err(format!("unknown handshake message kind {k}"))),
        };
        if !r.0.is_empty() {
            return Err(handshake_err("trailing bytes after handshake message"));
        }
        Ok(msg)
    }
}

/// Writes one length-prefixed message.
///
/// # Errors
/// On I/O failure.
pub async fn send<S: AsyncWriteExt + Unpin>(stream: &mut S, msg: &Message) -> Result<(), Error> {
    send_bytes(stream, &framed(msg)).await
}

/// Writes bytes of a message already framed (by [`framed`]).
///
/// # Errors
/// On I/O failure.
pub(crate) async fn send_bytes<S: AsyncWriteExt + Unpin>(
    stream: &mut S,
    bytes: &[u8],
) -> Result<(), Error> {
    stream.write_all(bytes).await.map_err(send_failed)?;
    stream.flush().await.map_err(send_failed)
}

/// The error of a handshake message that could not be sent.
pub(crate) fn send_failed(e: std::io::Error) -> Error {
    Error::with_source(TransportErrorKind::Connect, "sending handshake", e)
}

/// `msg` with its length prefix: the bytes [`send`] writes.
pub(crate) fn framed(msg: &Message) -> Vec<u8> {
    let body = msg.encode();
    let mut framed = Vec::with_capacity(4 + body.len());
    framed.extend_from_slice(&(body.len() as u32).to_le_bytes());
    framed.extend_from_slice(&body);
    framed
}

/// Writes what the socket `fd` takes of `bytes` now, without waiting (`MSG_DONTWAIT`): how
/// many bytes went. A handshake message fits the send buffer of a fresh connection, so this is
/// all of it but for a peer that stopped reading; the caller sends the rest the usual way.
///
/// # Errors
/// When the connection failed (reset, closed: `EPIPE` raises no signal).
pub(crate) fn send_now(fd: std::os::fd::BorrowedFd<'_>, bytes: &[u8]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: reads `bytes.len()` bytes from a live slice; `fd` is a valid descriptor for
        // the duration of the call.
        let n = unsafe {
            libc::send(
                fd.as_raw_fd(),
                bytes.as_ptr().cast(),
                bytes.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => {}
            std::io::ErrorKind::WouldBlock => return Ok(0),
            _ => return Err(e),
        }
    }
}

/// Reads one length-prefixed message within [`HANDSHAKE_TIMEOUT`].
///
/// # Errors
/// On timeout, I/O failure, an oversized length or an invalid message.
pub async fn recv<S: AsyncReadExt + Unpin>(stream: &mut S) -> Result<Message, Error> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, read_message(stream)).await {
        Err(_) => Err(handshake_err("peer sent no handshake within 5 s")),
        Ok(r) => r,
    }
}

/// Waits for the one message the server may send after [`Welcome`]: why it closes the
/// connection (a [`Refusal`]).
///
/// # Errors
/// [`TransportErrorKind::Io`] when the connection ends or fails without one; [`TransportErrorKind::Handshake`]
/// for anything else the server sent.
pub async fn recv_closing<S: AsyncReadExt + Unpin>(stream: &mut S) -> Result<Message, Error> {
    read_message(stream).await
}

/// One length-prefixed message.
async fn read_message<S: AsyncReadExt + Unpin>(stream: &mut S) -> Result<Message, Error> {
    let io = |e: std::io::Error| Error::with_source(TransportErrorKind::Io, "reading handshake", e);
    let mut len = [0u8; 4];
    stream.read_exact(&mut len).await.map_err(io)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(handshake_err(format!(
            "handshake message of {len} bytes is over the {MAX_MESSAGE}-byte limit: peer is not \
             an rdma-rpc endpoint"
        )));
    }
    let mut body = vec![0u8; len];
    stream.read_exact(&mut body).await.map_err(io)?;
    Message::decode(&body)
}

/// Constant-time comparison of tokens (no early exit on the first differing byte).
pub fn token_matches(expected: &[u8], got: &[u8]) -> bool {
    if expected.len() != got.len() {
        return false;
    }
    expected
        .iter()
        .zip(got)
        .fold(0u8, |acc, (a, b)| acc | (a ^ b))
        == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    fn ep() -> Endpoint {
        Endpoint {
            provider: Endpoint::PROVIDER_SOFT,
            port: 1,
            lid: 0,
            qp_num: 17,
            psn: 0x1234,
            mtu: 4096,
            gid: [7; 16],
            aux: 3,
        }
    }

    #[test]
    fn messages_round_trip() {
        let g = Geometry::default();
        for m in [
            Message::Hello(Hello {
                provider: 1,
                endpoint: ep(),
                geometry: g,
                initial_credits: 8,
                max_calls: 64,
                token: b"secret".to_vec(),
                data_endpoints: vec![ep(), ep(), ep()],
            }),
            Message::Welcome(Welcome {
                endpoint: ep(),
                geometry: g,
                initial_credits: 4,
                max_calls: 64,
                shard: 1,
                shards: 2,
                data_endpoints: vec![ep(); MAX_DATA_QPS],
            }),
            Message::Refusal(Refusal {
                reason: "bad token".into(),
                code: crate::Code::Unauthenticated,
            }),
        ] {
            assert_eq!(Message::decode(&m.encode()).unwrap(), m);
        }
    }

    #[test]
    fn long_refusal_reasons_are_cut_at_a_character() {
        let long = "shard full ✓".repeat(3000);
        let m = Message::Refusal(Refusal {
            reason: long.clone(),
            code: crate::Code::ResourceExhausted,
        });
        let Message::Refusal(r) = Message::decode(&m.encode()).unwrap() else {
            panic!("not a refusal");
        };
        assert!(r.reason.len() < long.len() && long.starts_with(&r.reason));
        assert_eq!(r.code, crate::Code::ResourceExhausted);
        // A refusal of a server that sets no code reads as UNAVAILABLE.
        let mut old = m.encode();
        old[7] = 0;
        let Message::Refusal(r) = Message::decode(&old).unwrap() else {
            panic!("not a refusal");
        };
        assert_eq!(r.code, crate::Code::Unavailable);
    }

    #[test]
    fn garbage_and_wrong_versions_are_refused_with_reasons() {
        let e = Message::decode(b"GET / HTTP/1.1\r\n").unwrap_err();
        assert!(e.to_string().contains("not an rdma-rpc endpoint"), "{e}");
        let mut m = Message::Refusal(Refusal {
            reason: String::new(),
            code: crate::Code::Unavailable,
        })
        .encode();
        m[4] = 9;
        let e = Message::decode(&m).unwrap_err();
        assert!(e.to_string().contains("version 9"), "{e}");
        // A peer of the release before batched SENDs (handshake 2, wire format 1).
        m[4] = 2;
        let e = Message::decode(&m).unwrap_err();
        assert!(
            e.to_string()
                .contains("version 2 not supported (this side speaks 8)"),
            "{e}"
        );
        // A peer of the release before credits from a shared pool (handshake 3, wire 2).
        m[4] = 3;
        let e = Message::decode(&m).unwrap_err();
        assert!(e.to_string().contains("version 3 not supported"), "{e}");
        // A peer of the release before stream windows above 16 messages (handshake 4).
        m[4] = 4;
        let e = Message::decode(&m).unwrap_err();
        assert!(e.to_string().contains("version 4 not supported"), "{e}");
        // A peer of the release before packed stream messages (handshake 5, wire 3).
        m[4] = 5;
        let e = Message::decode(&m).unwrap_err();
        assert!(e.to_string().contains("version 5 not supported"), "{e}");
        // A peer of the release before pending request payloads (handshake 6, wire 4).
        m[4] = 6;
        let e = Message::decode(&m).unwrap_err();
        assert!(e.to_string().contains("version 6 not supported"), "{e}");
        // A peer of the release before growing client windows (handshake 7, wire 5).
        m[4] = 7;
        let e = Message::decode(&m).unwrap_err();
        assert!(e.to_string().contains("version 7 not supported"), "{e}");
        let good = Message::Hello(Hello {
            provider: 1,
            endpoint: ep(),
            geometry: Geometry::default(),
            initial_credits: 8,
            max_calls: 64,
            token: vec![],
            data_endpoints: vec![],
        })
        .encode();
        for cut in 0..good.len() {
            assert!(Message::decode(&good[..cut]).is_err());
        }
        // Geometry (12 bytes), initial credits, call table size, data QP count.
        let mut bad_geom = good.clone();
        let off = good.len() - 21;
        bad_geom[off..off + 4].copy_from_slice(&7u32.to_le_bytes());
        assert!(Message::decode(&bad_geom).is_err());
        for credits in [0u32, 3, 129] {
            let mut bad = good.clone();
            bad[off + 12..off + 16].copy_from_slice(&credits.to_le_bytes());
            let e = Message::decode(&bad).unwrap_err();
            assert!(e.to_string().contains("initial credits"), "{e}");
        }
    }

    #[test]
    fn too_many_data_qps_are_refused() {
        let mut m = Message::Hello(Hello {
            provider: 1,
            endpoint: ep(),
            geometry: Geometry::default(),
            initial_credits: 8,
            max_calls: 64,
            token: vec![],
            data_endpoints: vec![],
        })
        .encode();
        let last = m.len() - 1;
        m[last] = MAX_DATA_QPS as u8 + 1;
        m.extend(std::iter::repeat_n(
            0,
            Endpoint::ENCODED_LEN * (MAX_DATA_QPS + 1),
        ));
        let e = Message::decode(&m).unwrap_err();
        assert!(e.to_string().contains("data QPs"), "{e}");
        // A count with missing endpoints is a truncated message.
        m.truncate(last + 1 + Endpoint::ENCODED_LEN);
        m[last] = 2;
        assert!(Message::decode(&m).is_err());
        // The largest message fits the limit.
        let big = Message::Welcome(Welcome {
            endpoint: ep(),
            geometry: Geometry::default(),
            initial_credits: 4,
            max_calls: 64,
            shard: 0,
            shards: 1,
            data_endpoints: vec![ep(); MAX_DATA_QPS],
        });
        assert!(big.encode().len() <= MAX_MESSAGE);
    }

    #[test]
    fn tokens_compare_exactly() {
        assert!(token_matches(b"abc", b"abc"));
        assert!(!token_matches(b"abc", b"abd"));
        assert!(!token_matches(b"abc", b"ab"));
        assert!(token_matches(b"", b""));
    }

    /// What the shard writes at once with `send_now` reads back as the message `recv` gets;
    /// a socket that takes nothing more says so (0 bytes sent), and a closed peer is an error
    /// without a signal.
    #[tokio::test]
    async fn framed_messages_sent_now_arrive_whole() {
        let msg = Message::Welcome(Welcome {
            endpoint: ep(),
            geometry: Geometry::default(),
            initial_credits: 4,
            max_calls: 64,
            shard: 1,
            shards: 2,
            data_endpoints: vec![ep()],
        });
        let bytes = framed(&msg);
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        assert_eq!(send_now(a.as_fd(), &bytes).unwrap(), bytes.len());
        b.set_nonblocking(true).unwrap();
        let mut b = tokio::net::UnixStream::from_std(b).unwrap();
        assert_eq!(recv(&mut b).await.unwrap(), msg);

        // Fill the socket's buffer: what does not fit is left to the caller, not waited for.
        a.set_nonblocking(true).unwrap();
        let chunk = vec![0u8; 64 << 10];
        while send_now(a.as_fd(), &chunk).unwrap() > 0 {}
        assert_eq!(send_now(a.as_fd(), &bytes).unwrap(), 0);

        drop(b);
        let e = send_now(a.as_fd(), &bytes).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EPIPE), "{e}");
    }

    #[tokio::test]
    async fn oversized_lengths_are_refused_before_reading() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
        let e = recv(&mut b).await.unwrap_err();
        assert!(e.to_string().contains("over the 1024-byte limit"), "{e}");
    }
}
