//! Which protocol a new TCP connection on the bootstrap port speaks, told from its first bytes
//! without consuming them (`peek`), so the side that serves it reads them again.
//!
//! - Our handshake starts with its message length (`u32` LE, at most
//!   [`connect::MAX_MESSAGE`](crate::connect::MAX_MESSAGE) = 1024), so its second byte is at
//!   most 4 and its third and fourth are 0; then the magic `RRPC`.
//! - An HTTP/2 client with prior knowledge (gRPC over cleartext: tonic, grpc-go, grpcio,
//!   grpcurl `-plaintext`) starts with the 24-byte client preface `PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n`,
//!   whose second byte is `R` (0x52).
//!
//! No handshake is a prefix of the preface, so the first byte that differs from the preface
//! settles it: anything that is not the whole preface goes to the handshake path, which
//! refuses what is not a handshake with its clear error. Only a peer that sends a proper prefix
//! of the preface and then stops makes us wait, bounded by the handshake timeout.

use std::time::Duration;

use tokio::net::TcpStream;
use tokio::time::Instant;

/// The HTTP/2 client connection preface (RFC 9113 §3.4).
pub(crate) const HTTP2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// Longest pause between two looks at a connection that sent part of the preface.
const MAX_BACKOFF: Duration = Duration::from_millis(50);

/// What a connection's first bytes say.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FirstBytes {
    /// The whole HTTP/2 client preface: a gRPC (or other HTTP/2) client.
    Http2,
    /// Anything else: our handshake, or garbage its reader refuses.
    Handshake,
    /// The peer closed (or the socket failed) before sending a byte.
    Closed,
    /// Nothing decisive within the limit (silence, or a prefix of the preface).
    Silent,
}

/// Classifies the bytes seen so far: `None` while they are a proper prefix of the preface.
pub(crate) fn classify(seen: &[u8]) -> Option<FirstBytes> {
    if seen.is_empty() {
        return None;
    }
    if !HTTP2_PREFACE.starts_with(seen) {
        return Some(FirstBytes::Handshake);
    }
    (seen.len() == HTTP2_PREFACE.len()).then_some(FirstBytes::Http2)
}

/// Looks at `stream`'s first bytes, for at most `limit`, without reading them.
///
/// # Cancel safety
/// Cancel safe: it only peeks.
pub(crate) async fn first_bytes(stream: &TcpStream, limit: Duration) -> FirstBytes {
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; HTTP2_PREFACE.len()];
    let mut backoff = Duration::from_millis(1);
    loop {
        let n = match tokio::time::timeout_at(deadline, stream.peek(&mut buf)).await {
            Err(_) => return FirstBytes::Silent,
            Ok(Err(_) | Ok(0)) => return FirstBytes::Closed,
            Ok(Ok(n)) => n,
        };
        if let Some(kind) = classify(&buf[..n]) {
            return kind;
        }
        // A proper prefix of the preface: `peek` would return the same bytes at once, so wait
        // a little before looking again instead of spinning.
        if Instant::now() + backoff >= deadline {
            return FirstBytes::Silent;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buf::Geometry;
    use crate::connect::{Hello, Message, Refusal};
    use crate::verbs::Endpoint;

    #[test]
    fn the_preface_and_only_the_preface_is_http2() {
        assert_eq!(classify(HTTP2_PREFACE), Some(FirstBytes::Http2));
        for cut in 0..HTTP2_PREFACE.len() {
            assert_eq!(classify(&HTTP2_PREFACE[..cut]), None, "prefix of {cut}");
        }
        let mut bad = *HTTP2_PREFACE;
        bad[23] = b'x';
        assert_eq!(classify(&bad), Some(FirstBytes::Handshake));
        assert_eq!(classify(b"GET / HTTP/1.1\r\n"), Some(FirstBytes::Handshake));
        assert_eq!(classify(&[0xff; 24]), Some(FirstBytes::Handshake));
    }

    #[test]
    fn no_handshake_is_taken_for_http2() {
        let ep = Endpoint {
            provider: Endpoint::PROVIDER_SOFT,
            port: 1,
            lid: 0,
            qp_num: 17,
            psn: 0x1234,
            mtu: 4096,
            gid: [b'R'; 16],
            aux: 3,
        };
        let hello = Message::Hello(Hello {
            provider: 1,
            endpoint: ep,
            geometry: Geometry::default(),
            initial_credits: 8,
            max_calls: 64,
            token: b"PRI * HTTP/2.0".to_vec(),
            data_endpoints: vec![],
        });
        let refusal = Message::Refusal(Refusal {
            reason: "x".repeat(80 - 10),
            code: crate::Code::Unavailable,
        });
        // Every length up to the limit, as the length prefix a handshake starts with.
        for len in 0..=crate::connect::MAX_MESSAGE as u32 {
            let mut framed = len.to_le_bytes().to_vec();
            framed.extend_from_slice(&hello.encode());
            assert_ne!(classify(&framed), Some(FirstBytes::Http2));
            assert_ne!(classify(&framed[..2]), None, "two bytes settle it");
        }
        for m in [hello, refusal] {
            let body = m.encode();
            let mut framed = (body.len() as u32).to_le_bytes().to_vec();
            framed.extend_from_slice(&body);
            assert_eq!(classify(&framed), Some(FirstBytes::Handshake));
        }
    }
}
