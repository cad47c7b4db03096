//! The bodies of the fuzz targets (`fuzz/fuzz_targets/*.rs` call these), public so that the
//! cargo-fuzz crate and the ordinary test suite (proptest input, no nightly needed) run the
//! same code. They panic only when the code under test breaks a property.

use super::conn::{CallId, Config, Conn, Role};
use super::frame::{
    Batch, BulkDesc, BulkMore, FrameFlags, FrameHeader, FrameKind, MAX_BULK_PIECES, MAX_HEADER_LEN,
    WIRE_VERSION, decode,
};
use crate::method::CallKind;

/// Decodes arbitrary bytes as the frames of one SEND (a batch: [`Batch`]); every frame that
/// decodes re-encodes to the same header bytes, its metadata and payload are the bytes right
/// after its header, it lies inside the SEND, and a batch that decodes to its end tiles the
/// SEND exactly (no byte skipped, none delivered twice). The first frame alone goes through
/// the same checks as a frame decoded on its own.
///
/// # Panics
/// When a decoded frame does not round-trip or a batch walk breaks those rules (a codec bug).
pub fn frame_decode(data: &[u8]) {
    if let Ok(f) = decode(data) {
        check_frame(data, &f);
    }
    let mut expect_at = 0usize;
    let mut last_more = false;
    let mut ended = false;
    for r in Batch::new(data) {
        assert!(!ended, "a batch walk went on after an error");
        let Ok((at, f)) = r else {
            ended = true;
            continue;
        };
        assert_eq!(
            at, expect_at,
            "a frame of a batch does not start where the last ended"
        );
        let rest = data.get(at..).unwrap_or_default();
        check_frame(rest, &f);
        expect_at = at + f.header.frame_len() as usize;
        assert!(
            expect_at <= data.len(),
            "a frame of a batch reaches past the SEND"
        );
        last_more = f.header.flags.contains(FrameFlags::MORE);
    }
    if !ended && expect_at > 0 {
        assert_eq!(
            expect_at,
            data.len(),
            "a batch that decoded left bytes over"
        );
        assert!(!last_more, "a batch that decoded ends with MORE");
    }
}

/// The checks of one decoded frame `f` at the start of `data`.
fn check_frame(data: &[u8], f: &super::frame::Frame<'_>) {
    let h = f.header;
    let mut out = [0u8; MAX_HEADER_LEN];
    let n = match h.encode(&mut out) {
        Ok(n) => n,
        Err(e) => panic!("decoded header does not re-encode: {e} ({h:?})"),
    };
    assert_eq!(n, h.encoded_len());
    let md_end = n + usize::from(h.metadata_len);
    let end = md_end + h.payload_len as usize;
    assert_eq!(h.frame_len(), end as u64);
    assert!(end <= data.len(), "frame longer than its buffer");
    assert_eq!(
        out.get(..n),
        data.get(..n),
        "header bytes differ after re-encode"
    );
    assert_eq!(Some(f.metadata), data.get(n..md_end));
    assert_eq!(Some(f.payload), data.get(md_end..end));
    metadata_decode(f.metadata);
}

/// Decodes arbitrary bytes as a metadata block (headers, and trailers after a separator);
/// whatever decodes re-encodes to the same bytes, and splits into sections that each decode
/// strictly.
///
/// # Panics
/// When a decoded block does not round-trip (a codec bug).
pub fn metadata_decode(data: &[u8]) {
    let Ok(md) = crate::Metadata::decode_block(data) else {
        return;
    };
    let mut out = vec![0u8; md.encoded_len()];
    assert_eq!(md.encode(&mut out), out.len());
    // An empty block may be spelt as a zero count; it encodes to nothing.
    if !(md.is_empty() && out.is_empty()) {
        assert_eq!(out, data, "metadata does not re-encode to the same bytes");
    }
    let (first, second) = md.split();
    for section in std::iter::once(first).chain(second) {
        let mut b = vec![0u8; section.encoded_len()];
        section.encode(&mut b);
        assert_eq!(crate::Metadata::decode(&b).as_ref(), Ok(&section));
    }
}

/// Reads fuzz input a byte at a time; zeros once it runs out.
struct Input<'a> {
    data: &'a [u8],
    pos: usize,
}

impl Input<'_> {
    fn done(&self) -> bool {
        self.pos >= self.data.len()
    }
    fn u8(&mut self) -> u8 {
        let b = self.data.get(self.pos).copied().unwrap_or(0);
        self.pos += 1;
        b
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.u8(), self.u8(), self.u8(), self.u8()])
    }
    fn bool(&mut self) -> bool {
        self.u8() & 1 == 1
    }
}

/// A fixed-capacity queue of headers in flight from one side to the other.
struct Wire {
    q: [Option<FrameHeader>; 32],
    head: usize,
    len: usize,
}

impl Wire {
    const fn new() -> Wire {
        Wire {
            q: [None; 32],
            head: 0,
            len: 0,
        }
    }
    fn push(&mut self, h: FrameHeader) {
        if self.len < self.q.len() {
            let i = (self.head + self.len) % self.q.len();
            self.q[i] = Some(h);
            self.len += 1;
        }
    }
    fn pop(&mut self) -> Option<FrameHeader> {
        if self.len == 0 {
            return None;
        }
        let h = self.q[self.head].take();
        self.head = (self.head + 1) % self.q.len();
        self.len -= 1;
        h
    }
}

/// The configuration the fuzzer runs: tiny tables, rings and windows so every limit is hit.
/// The server grants from a shared pool (windows of 4 to 10: [`Conn::grant`],
/// [`Conn::recv_withheld`], [`Conn::reclaim`]); the client's window of 4 grows to 10 by its
/// grants too, and shrinks by withholding (as a channel's receive window doubles, and gives
/// regions back).
pub const FUZZ_CONFIG: Config = Config {
    max_calls: 4,
    peer_max_calls: 4,
    initial_send_credits: 4,
    max_send_credits: 10,
    recv_depth: 4,
    recv_max: 10,
    reserved_credits: 2,
    credit_update_threshold: 2,
    eager_limit: 512,
    max_message: 4096,
    stream_window: 2,
    stream_window_max: 4,
};

/// Drives a client and a server [`Conn`] with operations read from `data`: legitimate
/// commands (start, request, respond, stream, cancel, expire, finish, credit updates), delivery
/// of what was built, forged headers and raw bytes. Errors are fine; panics and broken
/// invariants are not.
///
/// # Panics
/// When a [`Conn`] panics or breaks an internal invariant (credits not conserved, deadline
/// heap out of sync, ...).
pub fn conn_events(data: &[u8]) {
    let (Ok(mut client), Ok(mut server)) = (
        Conn::new(Role::Client, FUZZ_CONFIG),
        Conn::new(Role::Server, FUZZ_CONFIG),
    ) else {
        panic!("FUZZ_CONFIG does not validate");
    };
    let mut to_server = Wire::new();
    let mut to_client = Wire::new();
    let mut ids = [CallId(0); 8];
    let mut n_ids = 0usize;
    let mut now = 0u64;
    let mut inp = Input { data, pos: 0 };
    // No forged frame was handled yet: the server's view of the client's credits is then
    // never below the client's real count (what the shared pool relies on).
    let mut honest = true;
    while !inp.done() {
        let op = inp.u8();
        let pick = |inp: &mut Input<'_>, ids: &[CallId; 8]| -> CallId {
            let b = inp.u8();
            if b & 0x80 != 0 {
                // A raw id: any slot, any generation.
                CallId(u32::from(b & 0x7f) | u32::from(inp.u8() % 4) << 16)
            } else {
                ids[usize::from(b) % ids.len()]
            }
        };
        let bulk = |inp: &mut Input<'_>| -> Option<BulkDesc> {
            inp.bool().then(|| BulkDesc {
                addr: u64::from(inp.u32()),
                len: u64::from(inp.u16()),
                rkey: 7,
            })
        };
        let side_is_client = op & 0x80 != 0;
        match op & 0x1f {
            0 => {
                // Raw bytes, version byte fixed so decode gets past it more often.
                let mut buf = [0u8; 192];
                let len = usize::from(inp.u8()) % buf.len();
                for b in buf.iter_mut().take(len) {
                    *b = inp.u8();
                }
                buf[0] = WIRE_VERSION;
                if let Ok(f) = decode(&buf[..len]) {
                    honest = false;
                    let conn = if side_is_client {
                        &mut client
                    } else {
                        &mut server
                    };
                    let _ = conn.handle_frame(&f.header, now);
                }
            }
            1 => {
                // A forged header, validated like decode would.
                let Ok(kind) = FrameKind::from_u8(inp.u8() % 11 + 1) else {
                    continue;
                };
                let flags = FrameFlags::from_bits(inp.u16() & FrameFlags::KNOWN.bits())
                    .unwrap_or(FrameFlags::EMPTY);
                let call = pick(&mut inp, &ids);
                let b = bulk(&mut inp);
                let h = FrameHeader {
                    kind,
                    flags,
                    call_id: if kind.is_call_scoped() { call.0 } else { 0 },
                    aux: u32::from(inp.u8()),
                    credits: u16::from(inp.u8() % 8),
                    metadata_len: u16::from(inp.u8() % 4),
                    payload_len: u32::from(inp.u8() % 4),
                    seq: u32::from(inp.u8() % 4),
                    deadline: flags
                        .contains(FrameFlags::HAS_DEADLINE)
                        .then(|| u64::from(inp.u16())),
                    bulk: if flags.contains(FrameFlags::HAS_BULK) {
                        b.or(Some(BulkDesc {
                            addr: 0,
                            len: 1,
                            rkey: 0,
                        }))
                    } else {
                        None
                    },
                    bulk_more: if flags.contains(FrameFlags::BULK_PIECES) {
                        let n = usize::from(inp.u8()) % MAX_BULK_PIECES;
                        let more = [BulkDesc {
                            addr: 0,
                            len: u64::from(inp.u16()),
                            rkey: 2,
                        }; MAX_BULK_PIECES];
                        BulkMore::from_slice(&more[..n]).unwrap_or(BulkMore::NONE)
                    } else {
                        BulkMore::NONE
                    },
                    landing: flags.contains(FrameFlags::HAS_LANDING).then_some(BulkDesc {
                        addr: 0,
                        len: 600,
                        rkey: 1,
                    }),
                };
                if h.check().is_ok() {
                    honest = false;
                    let conn = if side_is_client {
                        &mut client
                    } else {
                        &mut server
                    };
                    let _ = conn.handle_frame(&h, now);
                }
            }
            2 => {
                let kind = match inp.u8() % 4 {
                    0 => CallKind::Unary,
                    1 => CallKind::ServerStreaming,
                    2 => CallKind::ClientStreaming,
                    _ => CallKind::Streaming,
                };
                let timeout = inp.bool().then(|| u64::from(inp.u8()));
                if let Ok(id) = client.start_call(u32::from(inp.u8()) + 1, kind, timeout, now) {
                    ids[n_ids % ids.len()] = id;
                    n_ids += 1;
                }
            }
            3 => {
                let call = pick(&mut inp, &ids);
                let b = bulk(&mut inp);
                let landing = inp.bool().then_some(BulkDesc {
                    addr: 0,
                    len: u64::from(inp.u16()),
                    rkey: 1,
                });
                let pl = usize::from(inp.u8());
                // Up to MAX_BULK_PIECES + 1 ranges (one too many is refused), lengths may be 0.
                let mut pieces = [BulkDesc::default(); MAX_BULK_PIECES + 1];
                let n = if b.is_some() {
                    usize::from(inp.u8()) % (MAX_BULK_PIECES + 2)
                } else {
                    0
                };
                for (i, p) in pieces.iter_mut().enumerate().take(n) {
                    *p = BulkDesc {
                        addr: u64::from(inp.u32()),
                        len: u64::from(inp.u16()),
                        rkey: i as u32,
                    };
                }
                let md = usize::from(inp.u8() % 8);
                let r = if n == 0 {
                    client.request(call, pl, md, b, landing, now)
                } else {
                    client.request_pieces(call, pl, md, &pieces[..n], landing, now)
                };
                if let Ok(h) = r {
                    to_server.push(h);
                }
            }
            4 => {
                let call = pick(&mut inp, &ids);
                let r = if inp.bool() {
                    let b = bulk(&mut inp);
                    let written = inp.bool();
                    server.response(call, usize::from(inp.u8()), 0, b, written)
                } else {
                    server.status(call, inp.u8(), usize::from(inp.u8()), 0)
                };
                if let Ok(h) = r {
                    to_client.push(h);
                }
            }
            5 => {
                let call = pick(&mut inp, &ids);
                let b = bulk(&mut inp);
                let pl = usize::from(inp.u8());
                // Without bulk, up to 3 more messages may be packed into the frame.
                let more = if b.is_none() { inp.u8() % 4 } else { 0 };
                let (conn, out) = if side_is_client {
                    (&mut client, &mut to_server)
                } else {
                    (&mut server, &mut to_client)
                };
                if let Ok(mut h) = conn.stream_message(call, pl, 0, b) {
                    let packed = (0..more)
                        .take_while(|_| conn.stream_message_packed(call).is_ok())
                        .count() as u32;
                    if more > 0 {
                        h.flags |= FrameFlags::PACKED;
                        h.aux = packed + 1;
                        h.payload_len = h.payload_len.max(4 * h.aux);
                    }
                    out.push(h);
                }
            }
            6 => {
                let call = pick(&mut inp, &ids);
                if let Ok(h) = client.end_of_stream(call) {
                    to_server.push(h);
                }
            }
            7 => {
                let call = pick(&mut inp, &ids);
                if (client.cancel_local(call) || inp.bool())
                    && let Ok(h) = client.cancel(call)
                {
                    to_server.push(h);
                }
            }
            8 => {
                let call = pick(&mut inp, &ids);
                let grant = u32::from(inp.u8() % 4);
                if side_is_client {
                    if let Ok(h) = client.window_update(call, grant) {
                        to_server.push(h);
                    }
                } else if let Ok(h) = server.window_update(call, grant) {
                    to_client.push(h);
                }
            }
            9 => {
                let call = pick(&mut inp, &ids);
                if side_is_client {
                    if let Ok(h) = client.bulk_release(call) {
                        to_server.push(h);
                    }
                } else if let Ok(h) = server.bulk_release(call) {
                    to_client.push(h);
                }
            }
            10 => {
                if side_is_client {
                    if let Ok(h) = client.credit_update() {
                        to_server.push(h);
                    }
                } else if let Ok(h) = server.credit_update() {
                    to_client.push(h);
                }
            }
            11 => {
                if let Ok(h) = server.go_away() {
                    to_client.push(h);
                }
            }
            12 => {
                now = now.saturating_add(u64::from(inp.u8()));
                while client.expire(now).is_some() {}
                while server.expire(now).is_some() {}
            }
            13 => {
                let call = pick(&mut inp, &ids);
                if side_is_client {
                    client.finish(call);
                } else {
                    server.finish(call);
                }
            }
            14 => {
                let n = u32::from(inp.u8() % 8);
                if side_is_client {
                    if inp.bool() {
                        // A channel's window shrinking: slots parked, not reposted.
                        let _ = client.recv_withheld(n);
                    } else {
                        let _ = client.recv_reposted(n);
                    }
                } else if inp.bool() {
                    // The slots go back to the shared pool, not to the client.
                    let _ = server.recv_withheld(n);
                } else {
                    let _ = server.recv_reposted(n);
                }
            }
            15 => {
                let n = u32::from(inp.u8() % 8);
                let _ = if side_is_client {
                    client.grant(n)
                } else {
                    server.grant(n)
                };
            }
            16 => {
                let keep = u32::from(inp.u8() % 8);
                if let Ok(h) = server.reclaim(keep) {
                    to_client.push(h);
                }
            }
            17 => {
                // A Request whose one-range payload is still being written.
                let call = pick(&mut inp, &ids);
                let len = u64::from(inp.u16());
                let landing = inp.bool().then_some(BulkDesc {
                    addr: 0,
                    len: 600,
                    rkey: 1,
                });
                let desc = BulkDesc {
                    addr: u64::from(inp.u32()),
                    len,
                    rkey: 3,
                };
                if let Ok(h) =
                    client.request_pending(call, usize::from(inp.u8() % 8), desc, landing, now)
                {
                    to_server.push(h);
                }
            }
            18 => {
                // What the client says is ready; out of order or too far is refused.
                let call = pick(&mut inp, &ids);
                let ready = u64::from(inp.u16()) | u64::from(inp.u8() % 2) << 32;
                if let Ok(h) = client.bulk_ready(call, ready) {
                    to_server.push(h);
                }
            }
            _ => {
                // Deliver what was built, in order, re-posting the slot at once.
                let (wire, conn) = if side_is_client {
                    (&mut to_client, &mut client)
                } else {
                    (&mut to_server, &mut server)
                };
                if let Some(h) = wire.pop() {
                    let mut buf = [0u8; MAX_HEADER_LEN];
                    if let Ok(n) = h.encode(&mut buf) {
                        // What is built must be what decodes (header only: lengths claimed
                        // past `n` make it Truncated, which is fine here).
                        if let Ok(f) = decode(&buf[..n]) {
                            assert_eq!(f.header, h);
                        }
                    } else {
                        panic!("a built header does not encode: {h:?}");
                    }
                    let _ = conn.handle_frame(&h, now);
                    let _ = conn.recv_reposted(1);
                }
            }
        }
        if let Err(e) = client.check_invariants() {
            panic!("client invariant broken: {e}");
        }
        if let Err(e) = server.check_invariants() {
            panic!("server invariant broken: {e}");
        }
        assert!(
            !honest || client.send_credits() <= server.peer_credits(),
            "the client holds {} credits, more than the server's view {}",
            client.send_credits(),
            server.peer_credits()
        );
        assert!(
            !honest || server.send_credits() <= client.peer_credits(),
            "the server holds {} credits, more than the client's view {}",
            server.send_credits(),
            client.peer_credits()
        );
    }
}
