//! Tests of the protocol core: two [`Conn`]s, a client and a server, wired through queues of
//! encoded frames (the fake transport) on a fake clock.

use std::collections::VecDeque;

use proptest::prelude::*;

use super::*;
use crate::method::CallKind;

const M: u32 = 0x1234;

fn cfg() -> Config {
    Config {
        max_calls: 8,
        peer_max_calls: 8,
        initial_send_credits: 8,
        max_send_credits: 8,
        recv_depth: 8,
        recv_max: 8,
        reserved_credits: 2,
        credit_update_threshold: 4,
        eager_limit: 1024,
        max_message: 1 << 20,
        stream_window: 2,
        stream_window_max: 2,
    }
}

/// A received frame: its event, metadata and payload.
#[derive(Debug)]
struct Got {
    ev: Event,
    md: Vec<u8>,
    payload: Vec<u8>,
}

/// The fake transport: frames travel encoded, in order, one queue per direction.
struct Link {
    c: Conn,
    s: Conn,
    to_s: VecDeque<Vec<u8>>,
    to_c: VecDeque<Vec<u8>>,
    now: u64,
    /// Re-post the receive slot as soon as a frame is handled.
    auto_repost: bool,
}

fn encode(h: &FrameHeader, md: &[u8], payload: &[u8]) -> Vec<u8> {
    assert_eq!(usize::from(h.metadata_len), md.len());
    assert_eq!(h.payload_len as usize, payload.len());
    let mut buf = vec![0u8; h.encoded_len() + md.len() + payload.len()];
    let n = h.encode(&mut buf).unwrap();
    buf[n..n + md.len()].copy_from_slice(md);
    buf[n + md.len()..].copy_from_slice(payload);
    buf
}

impl Link {
    fn new(cfg: Config) -> Link {
        Link {
            c: Conn::new(Role::Client, cfg).unwrap(),
            s: Conn::new(Role::Server, cfg).unwrap(),
            to_s: VecDeque::new(),
            to_c: VecDeque::new(),
            now: 1_000,
            auto_repost: true,
        }
    }

    fn send_c(&mut self, h: FrameHeader, md: &[u8], payload: &[u8]) {
        self.to_s.push_back(encode(&h, md, payload));
    }

    fn send_s(&mut self, h: FrameHeader, md: &[u8], payload: &[u8]) {
        self.to_c.push_back(encode(&h, md, payload));
    }

    fn handle(conn: &mut Conn, buf: &[u8], now: u64, repost: bool) -> Result<Got, ProtocolError> {
        // Slots are fixed-size and longer than frames.
        let mut slot = buf.to_vec();
        slot.resize(buf.len() + 64, 0xAA);
        let f = decode(&slot).unwrap();
        let r = conn.handle_frame(&f.header, now);
        if repost {
            conn.recv_reposted(1).unwrap();
        }
        r.map(|ev| Got {
            ev,
            md: f.metadata.to_vec(),
            payload: f.payload.to_vec(),
        })
    }

    fn deliver_to_server(&mut self) -> Result<Got, ProtocolError> {
        let buf = self.to_s.pop_front().expect("a frame for the server");
        Self::handle(&mut self.s, &buf, self.now, self.auto_repost)
    }

    fn deliver_to_client(&mut self) -> Result<Got, ProtocolError> {
        let buf = self.to_c.pop_front().expect("a frame for the client");
        Self::handle(&mut self.c, &buf, self.now, self.auto_repost)
    }

    fn check(&self) {
        self.c.check_invariants().unwrap();
        self.s.check_invariants().unwrap();
    }

    /// Starts a unary call and sends its request.
    fn unary(&mut self, payload: &[u8], timeout: Option<u64>) -> CallId {
        let call = self
            .c
            .start_call(M, CallKind::Unary, timeout, self.now)
            .unwrap();
        let h = self
            .c
            .request(call, payload.len(), 0, None, None, self.now)
            .unwrap();
        self.send_c(h, &[], payload);
        call
    }
}

#[test]
fn unary_round_trip() {
    let mut l = Link::new(cfg());
    let call =
        l.c.start_call(M, CallKind::Unary, Some(5_000), l.now)
            .unwrap();
    l.now += 100;
    let h = l.c.request(call, 4, 3, None, None, l.now).unwrap();
    assert_eq!(h.deadline, Some(4_900), "the request carries the time left");
    l.send_c(h, b"k=v", b"ping");
    l.now += 50;
    let got = l.deliver_to_server().unwrap();
    assert_eq!(
        got.ev,
        Event::Request {
            call,
            method_id: M,
            kind: CallKind::Unary,
            deadline_at: Some(1_150 + 4_900),
            bulk: None,
            bulk_more: BulkMore::NONE,
            pending: false,
            landing: None,
            replaced: None,
        }
    );
    assert_eq!((&got.md[..], &got.payload[..]), (&b"k=v"[..], &b"ping"[..]));
    let h = l.s.response(call, 4, 0, None, false).unwrap();
    assert_eq!(
        h.credits, 1,
        "the server returns the request's slot on the response"
    );
    l.send_s(h, &[], b"pong");
    let got = l.deliver_to_client().unwrap();
    assert_eq!(
        got.ev,
        Event::Response {
            call,
            bulk: None,
            written: false
        }
    );
    assert_eq!(got.payload, b"pong");
    assert!(l.c.finish(call));
    assert!(l.s.finish(call));
    assert!(!l.c.finish(call), "finish twice is a no-op");
    assert_eq!((l.c.calls_in_flight(), l.s.calls_in_flight()), (0, 0));
    assert_eq!(l.c.poll_timeout(), None);
    assert_eq!(l.s.poll_timeout(), None);
    assert_eq!(l.c.send_credits(), 8, "every credit came back");
    assert_eq!(
        l.s.send_credits(),
        7,
        "the client owes one, for the response"
    );
    assert_eq!(l.c.owed_credits(), 1);
    l.check();
}

#[test]
fn slots_are_reused_with_new_generations() {
    let mut l = Link::new(cfg());
    let mut seen = Vec::new();
    for i in 0..20u8 {
        let call = l.unary(&[i], None);
        seen.push(call);
        let Event::Request { call: sc, .. } = l.deliver_to_server().unwrap().ev else {
            panic!()
        };
        assert_eq!(sc, call);
        let h = l.s.status(call, 0, 0, 0).unwrap();
        l.send_s(h, &[], &[]);
        assert_eq!(
            l.deliver_to_client().unwrap().ev,
            Event::Status { call, code: 0 }
        );
        assert!(l.c.finish(call));
        assert!(l.s.finish(call));
        // Keep credits flowing both ways.
        if l.c.wants_credit_update() {
            let h = l.c.credit_update().unwrap();
            l.send_c(h, &[], &[]);
            assert_eq!(l.deliver_to_server().unwrap().ev, Event::CreditOnly);
        }
        l.check();
    }
    assert!(
        seen.iter().all(|c| c.slot() == 0),
        "LIFO reuse of the lowest slot"
    );
    let mut gens: Vec<u16> = seen.iter().map(|c| c.generation()).collect();
    gens.dedup();
    assert_eq!(gens.len(), 20, "every call of a slot has a new generation");
}

/// Call tables hold entries up to the highest slot used (and deadlines as many), not the
/// whole table: a connection that made one call at a time holds one entry per side; a frame
/// naming a slot never used meets a free entry (stale), not a missing one.
#[test]
fn call_tables_grow_with_the_highest_slot_used() {
    let mut l = Link::new(cfg());
    assert_eq!((l.c.table_entries(), l.s.table_entries()), (0, 0));
    for i in 0..5u8 {
        let call = l.unary(&[i], Some(10_000));
        l.deliver_to_server().unwrap();
        let h = l.s.status(call, 0, 0, 0).unwrap();
        l.send_s(h, &[], &[]);
        l.deliver_to_client().unwrap();
        assert!(l.c.finish(call) && l.s.finish(call));
        l.check();
    }
    assert_eq!((l.c.table_entries(), l.s.table_entries()), (1, 1));
    // Three in flight: slots 0..3, the tables double to 4 entries.
    let calls: Vec<CallId> = (0..3u8).map(|i| l.unary(&[i], Some(10_000))).collect();
    for _ in &calls {
        l.deliver_to_server().unwrap();
    }
    assert_eq!((l.c.table_entries(), l.s.table_entries()), (4, 4));
    l.check();
    // A cancel for slot 6, never used: a stale frame; the server's table covers it now
    // (doubled: all 8 slots).
    let ghost = CallId::new(6, 1);
    let h = FrameHeader::new(FrameKind::Cancel, ghost.0);
    l.send_c(h, &[], &[]);
    assert!(matches!(
        l.deliver_to_server().unwrap().ev,
        Event::Stale { call, .. } if call == ghost
    ));
    assert_eq!(l.s.table_entries(), 8);
    // Beyond the table (8 slots): a protocol error, and the table stays.
    let h = FrameHeader::new(FrameKind::Cancel, CallId::new(8, 1).0);
    l.send_c(h, &[], &[]);
    assert!(matches!(
        l.deliver_to_server(),
        Err(ProtocolError::BadCallId(_))
    ));
    assert_eq!(l.s.table_entries(), 8);
    l.check();
}

#[test]
fn too_many_calls_is_back_pressure() {
    let mut l = Link::new(Config {
        max_calls: 2,
        ..cfg()
    });
    let a = l.c.start_call(M, CallKind::Unary, None, 0).unwrap();
    let _b = l.c.start_call(M, CallKind::Unary, None, 0).unwrap();
    assert_eq!(
        l.c.start_call(M, CallKind::Unary, None, 0),
        Err(StartError::TooManyCalls)
    );
    assert!(l.c.finish(a));
    assert!(l.c.start_call(M, CallKind::Unary, None, 0).is_ok());
    assert_eq!(
        l.c.start_call(0, CallKind::Unary, None, 0),
        Err(StartError::BadMethod)
    );
    assert_eq!(
        l.s.start_call(M, CallKind::Unary, None, 0),
        Err(StartError::NotClient)
    );
    l.check();
}

#[test]
fn control_frames_still_go_when_data_credits_are_exhausted() {
    let mut l = Link::new(Config {
        initial_send_credits: 5,
        max_send_credits: 5,
        recv_depth: 5,
        recv_max: 5,
        ..cfg()
    });
    l.auto_repost = false; // the server's application holds the receive slots
    let calls: Vec<CallId> = (0..3).map(|_| l.unary(b"x", None)).collect();
    assert_eq!(l.c.data_credits(), 0);
    let d = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    assert_eq!(
        l.c.request(d, 1, 0, None, None, l.now),
        Err(SendError::NoCredit),
        "data frames stop at the reserve"
    );
    // The failed build changed nothing: the call can still go later.
    assert_eq!(l.c.send_credits(), 2);
    // A Cancel may use the reserve, but not the last credit.
    assert!(l.c.cancel_local(calls[0]));
    let h = l.c.cancel(calls[0]).unwrap();
    l.send_c(h, &[], &[]);
    assert!(l.c.cancel_local(calls[1]));
    assert_eq!(l.c.cancel(calls[1]), Err(SendError::NoCredit));
    for _ in 0..3 {
        assert!(matches!(
            l.deliver_to_server().unwrap().ev,
            Event::Request { .. }
        ));
    }
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::Cancel { call: calls[0] }
    );
    // The server is out of data credits too? No: it has its own. But it holds every slot the
    // client could use: nothing is owed until it re-posts.
    assert!(!l.s.wants_credit_update());
    l.s.recv_reposted(1).unwrap();
    assert!(
        !l.s.wants_credit_update(),
        "one owed credit is not worth a frame"
    );
    l.s.recv_reposted(3).unwrap();
    assert!(
        l.s.wants_credit_update(),
        "the client is down to its reserve"
    );
    // The server answers with a Status (control frame) carrying the credits.
    let h = l.s.status(calls[2], 13, 4, 0).unwrap();
    assert_eq!(h.credits, 4);
    l.send_s(h, &[], b"oops");
    let got = l.deliver_to_client().unwrap();
    assert_eq!(
        got.ev,
        Event::Status {
            call: calls[2],
            code: 13
        }
    );
    assert_eq!(got.payload, b"oops");
    assert_eq!(l.c.send_credits(), 5);
    // The held-back call goes now.
    let h = l.c.request(d, 1, 0, None, None, l.now).unwrap();
    l.send_c(h, &[], b"y");
    assert!(matches!(l.deliver_to_server().unwrap().ev, Event::Request { call, .. } if call == d));
    l.check();
}

#[test]
fn the_last_credit_is_for_credit_updates() {
    let mut l = Link::new(Config {
        initial_send_credits: 4,
        max_send_credits: 4,
        recv_depth: 4,
        recv_max: 4,
        credit_update_threshold: 2,
        ..cfg()
    });
    l.auto_repost = false;
    let a = l.unary(b"a", None);
    let _b = l.unary(b"b", None);
    assert_eq!(l.c.send_credits(), 2);
    // Server: take the requests, re-post one slot, owe one.
    l.deliver_to_server().unwrap();
    l.deliver_to_server().unwrap();
    l.s.recv_reposted(1).unwrap();
    // Client: a Cancel uses one, leaving the last.
    assert!(l.c.cancel_local(a));
    let h = l.c.cancel(a).unwrap();
    l.send_c(h, &[], &[]);
    assert_eq!(l.c.send_credits(), 1);
    let idle =
        l.c.start_call(M, CallKind::ServerStreaming, None, 0)
            .unwrap();
    assert_eq!(
        l.c.cancel(idle),
        Err(SendError::BadState(
            "the Request was never sent: nothing to cancel, finish the call"
        ))
    );
    assert_eq!(l.c.bulk_release(a), Err(SendError::NoCredit));
    assert_eq!(
        l.c.credit_update(),
        Err(SendError::Invalid("CreditUpdate with no credit owed"))
    );
    // The server owes; a CreditUpdate may take its last credit too, but it has plenty.
    l.deliver_to_server().unwrap(); // Cancel
    l.s.recv_reposted(2).unwrap();
    assert!(l.s.wants_credit_update());
    let h = l.s.credit_update().unwrap();
    assert_eq!(h.credits, 3);
    l.send_s(h, &[], &[]);
    assert_eq!(l.deliver_to_client().unwrap().ev, Event::CreditOnly);
    assert_eq!(l.c.send_credits(), 4);
    // Down to the last credit, only a CreditUpdate goes.
    for _ in 0..3 {
        let h = l.c.bulk_release(a).unwrap();
        l.send_c(h, &[], &[]);
    }
    assert_eq!(l.c.send_credits(), 1);
    assert_eq!(l.c.bulk_release(a), Err(SendError::NoCredit));
    l.c.recv_reposted(1).unwrap();
    let h = l.c.credit_update().unwrap();
    assert_eq!(h.credits, 1);
    assert_eq!(l.c.send_credits(), 0);
    assert_eq!(
        l.c.credit_update(),
        Err(SendError::Invalid("CreditUpdate with no credit owed"))
    );
    assert_eq!(
        l.c.recv_reposted(1),
        Err(SendError::Invalid(
            "more receive slots re-posted than frames received"
        ))
    );
    l.check();
}

#[test]
fn a_starved_peer_always_gets_its_credits_back() {
    // The smallest legal rings: reserve 2, depth 4, so at most 2 data credits, and a threshold
    // that is never reached by itself. The client sends as many requests as it can, the
    // server answers with data frames as it can, and credits return only on traffic or when
    // `wants_credit_update` says so. Nothing may ever get stuck.
    let mut l = Link::new(Config {
        initial_send_credits: 4,
        max_send_credits: 4,
        recv_depth: 4,
        recv_max: 4,
        credit_update_threshold: 4,
        ..cfg()
    });
    let mut pending: VecDeque<CallId> = VecDeque::new();
    let mut done = 0;
    for _step in 0..2_000 {
        let mut progress = false;
        while l.c.data_credits() > 0 && pending.len() < 6 {
            let call = l.unary(b"q", None);
            pending.push_back(call);
            progress = true;
        }
        while !l.to_s.is_empty() {
            l.deliver_to_server().unwrap();
            progress = true;
        }
        while let Some(&call) = pending.front() {
            match l.s.response(call, 1, 0, None, false) {
                Ok(h) => {
                    l.send_s(h, &[], b"a");
                    l.s.finish(call);
                    pending.pop_front();
                    progress = true;
                }
                Err(SendError::NoCredit) => break,
                Err(e) => panic!("{e}"),
            }
        }
        while !l.to_c.is_empty() {
            if let Event::Response { call, .. } = l.deliver_to_client().unwrap().ev {
                l.c.finish(call);
                done += 1;
            }
            progress = true;
        }
        for client in [true, false] {
            let conn = if client { &mut l.c } else { &mut l.s };
            if conn.wants_credit_update() {
                let h = conn.credit_update().unwrap();
                if client {
                    l.send_c(h, &[], &[]);
                    l.deliver_to_server().unwrap();
                } else {
                    l.send_s(h, &[], &[]);
                    l.deliver_to_client().unwrap();
                }
                progress = true;
            }
        }
        l.check();
        assert!(progress, "stuck after {done} calls: {:?} / {:?}", l.c, l.s);
    }
    assert!(done > 1_000, "{done} calls in 2,000 steps");
}

#[test]
fn one_way_streams_never_stall() {
    // Only the server sends data; the client returns credits with CreditUpdates alone (the
    // stream window is large enough never to need a WindowUpdate). At the smallest legal
    // rings the server must never be left waiting.
    let mut l = Link::new(Config {
        initial_send_credits: 4,
        max_send_credits: 4,
        recv_depth: 4,
        recv_max: 4,
        credit_update_threshold: 4,
        stream_window: 10_000,
        stream_window_max: 10_000,
        ..cfg()
    });
    let call =
        l.c.start_call(M, CallKind::ServerStreaming, None, l.now)
            .unwrap();
    let h = l.c.request(call, 0, 0, None, None, l.now).unwrap();
    l.send_c(h, &[], &[]);
    l.deliver_to_server().unwrap();
    let mut received = 0;
    for _step in 0..1_000 {
        let mut progress = false;
        while let Ok(h) = l.s.stream_message(call, 1, 0, None) {
            l.send_s(h, &[], b"m");
            progress = true;
        }
        while !l.to_c.is_empty() {
            if let Event::StreamMessage { .. } = l.deliver_to_client().unwrap().ev {
                received += 1;
            }
            progress = true;
        }
        if l.c.wants_credit_update() {
            let h = l.c.credit_update().unwrap();
            l.send_c(h, &[], &[]);
            l.deliver_to_server().unwrap();
            progress = true;
        }
        l.check();
        assert!(
            progress,
            "stalled after {received} messages: {:?} / {:?}",
            l.c, l.s
        );
    }
    assert!(received >= 1_000);
}

#[test]
fn credit_updates_never_ping_pong() {
    // Two idle peers that send a CreditUpdate whenever they are told to must go quiet.
    let mut l = Link::new(Config {
        credit_update_threshold: 2,
        ..cfg()
    });
    for _ in 0..4 {
        let call = l.unary(b"", None);
        l.deliver_to_server().unwrap();
        let h = l.s.response(call, 0, 0, None, false).unwrap();
        l.send_s(h, &[], &[]);
        l.deliver_to_client().unwrap();
        l.c.finish(call);
        l.s.finish(call);
    }
    let mut frames = 0;
    for _ in 0..100 {
        let mut quiet = true;
        if l.c.wants_credit_update() {
            let h = l.c.credit_update().unwrap();
            l.send_c(h, &[], &[]);
            l.deliver_to_server().unwrap();
            quiet = false;
            frames += 1;
        }
        if l.s.wants_credit_update() {
            let h = l.s.credit_update().unwrap();
            l.send_s(h, &[], &[]);
            l.deliver_to_client().unwrap();
            quiet = false;
            frames += 1;
        }
        if quiet {
            break;
        }
    }
    assert!(
        frames <= 3,
        "{frames} credit updates for an idle connection"
    );
    assert!(!l.c.wants_credit_update() && !l.s.wants_credit_update());
    l.check();
}

#[test]
fn stale_frames_after_cancel() {
    let mut l = Link::new(cfg());
    let call = l.unary(b"q", None);
    l.deliver_to_server().unwrap();
    // Race: the server answers with a bulk response while the client gives up.
    let bulk = BulkDesc {
        addr: 0x7000,
        len: 1 << 16,
        rkey: 9,
    };
    let h = l.s.response(call, 0, 0, Some(bulk), false).unwrap();
    l.send_s(h, &[], &[]);
    assert!(l.c.cancel_local(call));
    assert!(l.c.cancel_local(call), "still to be sent");
    let h = l.c.cancel(call).unwrap();
    l.send_c(h, &[], &[]);
    assert!(!l.c.cancel_local(call), "sent already");
    assert_eq!(
        l.c.cancel(call),
        Err(SendError::BadState("Cancel already sent"))
    );
    // The response is stale at the client, which gives the bulk buffer back.
    assert_eq!(
        l.deliver_to_client().unwrap().ev,
        Event::Stale {
            call,
            kind: FrameKind::Response,
            bulk: Some(bulk)
        }
    );
    let h = l.c.bulk_release(call).unwrap();
    l.send_c(h, &[], &[]);
    // The Cancel is harmless at the server: the call was already closed.
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::Stale {
            call,
            kind: FrameKind::Cancel,
            bulk: None
        }
    );
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::BulkRelease { call }
    );
    assert!(l.c.finish(call));
    assert!(l.s.finish(call));

    // Cancel before the server answered: the server is told, and its answer is refused.
    let call = l.unary(b"q", None);
    l.deliver_to_server().unwrap();
    assert!(l.c.cancel_local(call));
    let h = l.c.cancel(call).unwrap();
    l.send_c(h, &[], &[]);
    assert_eq!(l.deliver_to_server().unwrap().ev, Event::Cancel { call });
    assert_eq!(l.s.status(call, 1, 0, 0), Err(SendError::Gone));
    assert_eq!(l.s.response(call, 0, 0, None, false), Err(SendError::Gone));
    // A Cancel for a call whose request never went needs no frame.
    let idle = l.c.start_call(M, CallKind::Unary, None, 0).unwrap();
    assert!(!l.c.cancel_local(idle));
    assert_eq!(
        l.c.request(idle, 0, 0, None, None, l.now),
        Err(SendError::Gone)
    );
    l.check();
}

#[test]
fn a_cancel_that_waited_for_credit_goes_after_its_call_is_finished() {
    let mut l = Link::new(cfg());
    let call = l.unary(b"q", None);
    l.deliver_to_server().unwrap();
    // The client gives the call up and forgets it; its Cancel waited for credit meanwhile.
    assert!(l.c.cancel_local(call));
    assert!(l.c.finish(call));
    assert_eq!(l.c.cancel(call), Err(SendError::BadCall(call)));
    let h = l.c.cancel_finished(call).unwrap();
    l.send_c(h, &[], &[]);
    // The server still ran it: the Cancel ends it there.
    assert_eq!(l.deliver_to_server().unwrap().ev, Event::Cancel { call });
    assert_eq!(l.s.status(call, 1, 0, 0), Err(SendError::Gone));
    assert!(l.s.finish(call));

    // A newer call took the slot and replaced the old one at the server: the late Cancel is
    // stale there and leaves the newer call alone.
    let old = l.unary(b"q", None);
    l.deliver_to_server().unwrap();
    assert!(l.c.cancel_local(old));
    assert!(l.c.finish(old));
    let new = l.unary(b"r", None);
    assert_eq!(new.slot(), old.slot(), "the slot is reused");
    assert_eq!(
        l.c.cancel_finished(new),
        Err(SendError::BadCall(new)),
        "a live call's Cancel is `cancel`"
    );
    let h = l.c.cancel_finished(old).unwrap();
    l.send_c(h, &[], &[]);
    assert!(matches!(
        l.deliver_to_server().unwrap().ev,
        Event::Request { call, .. } if call == new
    ));
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::Stale {
            call: old,
            kind: FrameKind::Cancel,
            bulk: None
        }
    );
    let h = l.s.response(new, 1, 0, None, false).unwrap();
    l.send_s(h, &[], b"a");
    assert!(matches!(
        l.deliver_to_client().unwrap().ev,
        Event::Response { call, .. } if call == new
    ));
    // Ids no call could have had, and servers, are refused.
    assert!(matches!(
        l.c.cancel_finished(CallId(0)),
        Err(SendError::BadCall(_))
    ));
    assert!(l.s.cancel_finished(old).is_err());
    l.check();
}

#[test]
fn deadlines_expire_in_order_and_late_frames_are_stale() {
    let mut l = Link::new(cfg());
    let t0 = l.now;
    let a = l.unary(b"a", Some(300));
    let b = l.unary(b"b", Some(100));
    let c = l.unary(b"c", Some(200));
    let d = l.unary(b"d", None);
    assert_eq!(l.c.poll_timeout(), Some(t0 + 100));
    assert_eq!(l.c.expire(t0 + 99), None);
    assert_eq!(l.c.expire(t0 + 150), Some(b));
    assert_eq!(l.c.expire(t0 + 150), None);
    assert_eq!(l.c.poll_timeout(), Some(t0 + 200));
    assert_eq!(l.c.expire(t0 + 1_000), Some(c));
    assert_eq!(l.c.expire(t0 + 1_000), Some(a));
    assert_eq!(l.c.expire(t0 + 1_000), None);
    assert_eq!(l.c.poll_timeout(), None);
    // The server got the deadlines as time left, against its own clock.
    l.now = 50_000;
    for want in [a, b, c, d] {
        let Event::Request {
            call, deadline_at, ..
        } = l.deliver_to_server().unwrap().ev
        else {
            panic!()
        };
        assert_eq!(call, want);
        let left = [(a, Some(300)), (b, Some(100)), (c, Some(200)), (d, None)]
            .iter()
            .find(|(x, _)| *x == call)
            .unwrap()
            .1;
        assert_eq!(deadline_at, left.map(|t| 50_000 + t));
    }
    assert_eq!(l.s.poll_timeout(), Some(50_100));
    assert_eq!(l.s.expire(50_100), Some(b));
    assert_eq!(l.s.status(b, 4, 0, 0), Err(SendError::Gone));
    // Responses to calls the client expired are stale there; an expired client call may
    // still tell the server with a Cancel.
    let h = l.s.response(a, 1, 0, None, false).unwrap();
    l.send_s(h, &[], b"A");
    assert_eq!(
        l.deliver_to_client().unwrap().ev,
        Event::Stale {
            call: a,
            kind: FrameKind::Response,
            bulk: None
        }
    );
    assert!(l.c.cancel_local(c));
    let h = l.c.cancel(c).unwrap();
    l.send_c(h, &[], &[]);
    assert_eq!(l.deliver_to_server().unwrap().ev, Event::Cancel { call: c });
    // A request whose deadline passed before it could be sent is refused.
    let e = l.c.start_call(M, CallKind::Unary, Some(10), l.now).unwrap();
    assert_eq!(
        l.c.request(e, 0, 0, None, None, l.now + 10),
        Err(SendError::Expired)
    );
    l.check();
}

#[test]
fn server_stream_window_flow_control() {
    let mut l = Link::new(cfg()); // stream_window = 2
    let call =
        l.c.start_call(M, CallKind::ServerStreaming, None, l.now)
            .unwrap();
    let h = l.c.request(call, 1, 0, None, None, l.now).unwrap();
    assert!(
        h.flags
            .contains(FrameFlags::END_STREAM | FrameFlags::SERVER_STREAM)
    );
    l.send_c(h, &[], b"n");
    assert!(matches!(
        l.deliver_to_server().unwrap().ev,
        Event::Request {
            kind: CallKind::ServerStreaming,
            ..
        }
    ));
    assert!(matches!(
        l.s.response(call, 0, 0, None, false),
        Err(SendError::BadState(_))
    ));
    for i in 0..2u8 {
        let h = l.s.stream_message(call, 1, 0, None).unwrap();
        assert_eq!(h.seq, u32::from(i));
        l.send_s(h, &[], &[i]);
    }
    assert_eq!(l.s.stream_message(call, 1, 0, None), Err(SendError::Window));
    for i in 0..2u32 {
        assert_eq!(
            l.deliver_to_client().unwrap().ev,
            Event::StreamMessage {
                call,
                seq: i,
                bulk: None,
                packed: 0
            }
        );
    }
    assert!(matches!(
        l.c.window_update(call, 3),
        Err(SendError::Invalid(_))
    ));
    let h = l.c.window_update(call, 2).unwrap();
    l.send_c(h, &[], &[]);
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::WindowUpdate { call, grant: 2 }
    );
    let h = l.s.stream_message(call, 1, 0, None).unwrap();
    assert_eq!(h.seq, 2);
    l.send_s(h, &[], b"2");
    let h = l.s.status(call, 0, 0, 0).unwrap();
    l.send_s(h, &[], &[]);
    assert!(matches!(
        l.deliver_to_client().unwrap().ev,
        Event::StreamMessage { seq: 2, .. }
    ));
    assert_eq!(
        l.deliver_to_client().unwrap().ev,
        Event::Status { call, code: 0 }
    );
    // After the final status the server may send nothing more.
    assert_eq!(l.s.stream_message(call, 1, 0, None), Err(SendError::Gone));
    l.check();
}

#[test]
fn a_receiver_opens_a_stream_window_up_to_the_maximum() {
    let (mut l, call) = server_stream(2, 6);
    // Before any message arrived the client opens the window to the maximum, not past it.
    assert!(matches!(
        l.c.window_update(call, 5),
        Err(SendError::Invalid(_))
    ));
    let h = l.c.window_update(call, 4).unwrap();
    l.send_c(h, &[], &[]);
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::WindowUpdate { call, grant: 4 }
    );
    for i in 0..6u8 {
        let h = l.s.stream_message(call, 1, 0, None).unwrap();
        l.send_s(h, &[], &[i]);
    }
    assert_eq!(l.s.stream_message(call, 1, 0, None), Err(SendError::Window));
    for _ in 0..6 {
        l.deliver_to_client().unwrap();
    }
    // A forged grant past the maximum is a protocol error at the sender.
    let forged = FrameHeader {
        aux: 7,
        ..FrameHeader::new(FrameKind::WindowUpdate, call.0)
    };
    l.send_c(forged, &[], &[]);
    assert!(matches!(
        l.deliver_to_server().unwrap_err(),
        ProtocolError::WindowOverflow { max: 6, .. }
    ));
}

/// Packs `msgs` into the stream frame `h` (built by `stream_message` for the first of them)
/// as a sender's link does: the frame and its bytes.
fn pack(mut h: FrameHeader, msgs: &[&[u8]]) -> (FrameHeader, Vec<u8>) {
    let first = msgs[0];
    h.payload_len = first.len() as u32;
    let mut slot = encode(&h, &[], first);
    slot.resize(4096, 0);
    for m in &msgs[1..] {
        crate::wire::packed::append(&mut slot, m.len(), |out| {
            out.get_mut(..m.len())?.copy_from_slice(m);
            Some(m.len())
        })
        .unwrap();
    }
    let f = decode(&slot).unwrap();
    let len = f.header.frame_len() as usize;
    let h = f.header;
    slot.truncate(len);
    (h, slot)
}

/// A link with a server-streaming call open (its request delivered), stream windows of
/// `window` messages, opened to at most `max`.
fn server_stream(window: u32, max: u32) -> (Link, CallId) {
    let mut l = Link::new(Config {
        stream_window: window,
        stream_window_max: max,
        ..cfg()
    });
    let call =
        l.c.start_call(M, CallKind::ServerStreaming, None, l.now)
            .unwrap();
    let h = l.c.request(call, 1, 0, None, None, l.now).unwrap();
    l.send_c(h, &[], b"n");
    l.deliver_to_server().unwrap();
    (l, call)
}

#[test]
fn packed_stream_messages_use_the_window_and_sequence_of_each() {
    let (mut l, call) = server_stream(4, 4);
    // Three messages in one frame, then one alone: the window (4) is spent.
    let h = l.s.stream_message(call, 1, 0, None).unwrap();
    l.s.stream_message_packed(call).unwrap();
    l.s.stream_message_packed(call).unwrap();
    let (ph, bytes) = pack(h, &[b"a", b"bc", b""]);
    assert_eq!((ph.aux, ph.seq), (3, 0));
    l.to_c.push_back(bytes);
    let h = l.s.stream_message(call, 1, 0, None).unwrap();
    assert_eq!(
        h.seq, 3,
        "the packed messages took sequence numbers 0, 1 and 2"
    );
    l.send_s(h, &[], b"d");
    assert_eq!(
        l.s.stream_message_packed(call),
        Err(SendError::Window),
        "a packed message needs window like any"
    );
    let got = l.deliver_to_client().unwrap();
    assert_eq!(
        got.ev,
        Event::StreamMessage {
            call,
            seq: 0,
            bulk: None,
            packed: 3
        }
    );
    assert!(crate::wire::packed::check(&got.payload, 3).is_ok());
    assert!(matches!(
        l.deliver_to_client().unwrap().ev,
        Event::StreamMessage {
            seq: 3,
            packed: 0,
            ..
        }
    ));
    // A forged packed frame past the window: refused whole.
    let h = l.c.window_update(call, 2).unwrap();
    l.send_c(h, &[], &[]);
    l.deliver_to_server().unwrap();
    let h = FrameHeader {
        seq: 4,
        ..FrameHeader::new(FrameKind::StreamMessage, call.0)
    };
    let (forged, bytes) = pack(h, &[b"1", b"2", b"3"]);
    assert_eq!(forged.aux, 3);
    l.to_c.push_back(bytes);
    assert_eq!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::WindowExceeded(call)
    );
    l.check();
}

#[test]
fn stream_violations_are_protocol_errors() {
    let mut l = Link::new(cfg());
    let call =
        l.c.start_call(M, CallKind::ServerStreaming, None, l.now)
            .unwrap();
    let h = l.c.request(call, 0, 0, None, None, l.now).unwrap();
    l.send_c(h, &[], &[]);
    l.deliver_to_server().unwrap();
    // A forged message out of sequence.
    let forged = FrameHeader {
        seq: 1,
        ..FrameHeader::new(FrameKind::StreamMessage, call.0)
    };
    l.send_s(forged, &[], &[]);
    assert_eq!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::SequenceGap {
            call,
            expected: 0,
            got: 1
        }
    );
    // Beyond the window (2).
    for seq in 0..3 {
        l.send_s(
            FrameHeader {
                seq,
                ..FrameHeader::new(FrameKind::StreamMessage, call.0)
            },
            &[],
            &[],
        );
    }
    assert!(l.deliver_to_client().is_ok());
    assert!(l.deliver_to_client().is_ok());
    assert_eq!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::WindowExceeded(call)
    );
    // A window update on a call with no client stream.
    l.send_s(
        FrameHeader {
            aux: 1,
            ..FrameHeader::new(FrameKind::WindowUpdate, call.0)
        },
        &[],
        &[],
    );
    assert!(matches!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::Unexpected { .. }
    ));
    l.check();
}

#[test]
fn client_stream_and_half_close() {
    let mut l = Link::new(cfg());
    let call =
        l.c.start_call(M, CallKind::ClientStreaming, None, l.now)
            .unwrap();
    assert!(matches!(
        l.c.request(call, 5, 0, None, None, l.now),
        Err(SendError::Invalid(_))
    ));
    assert!(matches!(
        l.c.stream_message(call, 1, 0, None),
        Err(SendError::BadState(_))
    ));
    let h = l.c.request(call, 0, 2, None, None, l.now).unwrap();
    assert!(!h.flags.contains(FrameFlags::END_STREAM));
    l.send_c(h, b"md", &[]);
    assert!(matches!(
        l.deliver_to_server().unwrap().ev,
        Event::Request {
            kind: CallKind::ClientStreaming,
            ..
        }
    ));
    let big = BulkDesc {
        addr: 1,
        len: 1 << 19,
        rkey: 3,
    };
    let h = l.c.stream_message(call, 0, 0, Some(big)).unwrap();
    l.send_c(h, &[], &[]);
    let h = l.c.stream_message(call, 3, 0, None).unwrap();
    l.send_c(h, &[], b"abc");
    assert_eq!(l.c.stream_message(call, 1, 0, None), Err(SendError::Window));
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::StreamMessage {
            call,
            seq: 0,
            bulk: Some(big),
            packed: 0
        }
    );
    assert_eq!(l.deliver_to_server().unwrap().payload, b"abc");
    let h = l.s.window_update(call, 2).unwrap();
    l.send_s(h, &[], &[]);
    assert_eq!(
        l.deliver_to_client().unwrap().ev,
        Event::WindowUpdate { call, grant: 2 }
    );
    let h = l.c.end_of_stream(call).unwrap();
    assert_eq!(h.seq, 2, "EndOfStream carries the message count");
    l.send_c(h, &[], &[]);
    assert!(matches!(
        l.c.stream_message(call, 1, 0, None),
        Err(SendError::BadState(_))
    ));
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::EndOfStream { call }
    );
    let h = l.s.response(call, 2, 0, None, false).unwrap();
    l.send_s(h, &[], b"ok");
    assert!(matches!(
        l.deliver_to_client().unwrap().ev,
        Event::Response { .. }
    ));

    // An EndOfStream that claims a message the server never got.
    let call = l.c.start_call(M, CallKind::Streaming, None, l.now).unwrap();
    let h = l.c.request(call, 0, 0, None, None, l.now).unwrap();
    l.send_c(h, &[], &[]);
    assert!(matches!(
        l.deliver_to_server().unwrap().ev,
        Event::Request {
            kind: CallKind::Streaming,
            ..
        }
    ));
    l.send_c(
        FrameHeader {
            seq: 1,
            ..FrameHeader::new(FrameKind::EndOfStream, call.0)
        },
        &[],
        &[],
    );
    assert_eq!(
        l.deliver_to_server().unwrap_err(),
        ProtocolError::SequenceGap {
            call,
            expected: 0,
            got: 1
        }
    );
    l.check();
}

#[test]
fn go_away_stops_new_calls_only() {
    let mut l = Link::new(cfg());
    let call = l.unary(b"x", None);
    l.deliver_to_server().unwrap();
    let h = l.s.go_away().unwrap();
    l.send_s(h, &[], &[]);
    assert!(l.s.is_going_away());
    assert_eq!(l.deliver_to_client().unwrap().ev, Event::GoAway);
    assert!(l.c.is_going_away());
    assert_eq!(
        l.c.start_call(M, CallKind::Unary, None, 0),
        Err(StartError::GoingAway)
    );
    assert_eq!(
        l.c.go_away(),
        Err(SendError::BadState("only a server sends GoAway"))
    );
    let h = l.s.response(call, 1, 0, None, false).unwrap();
    l.send_s(h, &[], b"y");
    assert!(matches!(
        l.deliver_to_client().unwrap().ev,
        Event::Response { .. }
    ));
    assert!(l.c.finish(call));
    assert!(l.s.finish(call));
    assert_eq!(l.s.calls_in_flight(), 0, "drained");
    l.check();
}

#[test]
fn a_reused_slot_replaces_an_abandoned_call() {
    let mut l = Link::new(cfg());
    let old = l.unary(b"1", None);
    l.deliver_to_server().unwrap();
    // The client forgets the call without a Cancel (say its deadline passed and it had no
    // credit for a Cancel), and reuses the slot.
    assert!(l.c.finish(old));
    let new = l.unary(b"2", None);
    assert_eq!(new.slot(), old.slot());
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::Request {
            call: new,
            method_id: M,
            kind: CallKind::Unary,
            deadline_at: None,
            bulk: None,
            bulk_more: BulkMore::NONE,
            pending: false,
            landing: None,
            replaced: Some(old),
        }
    );
    assert_eq!(l.s.status(old, 0, 0, 0), Err(SendError::Gone));
    assert!(!l.s.finish(old), "the old call is gone");
    assert_eq!(l.s.calls_in_flight(), 1);
    l.check();
}

#[test]
fn landing_zone_responses() {
    let mut l = Link::new(cfg()); // eager_limit 1024
    let landing = BulkDesc {
        addr: 0x9000,
        len: 4096,
        rkey: 5,
    };
    let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    let h = l.c.request(call, 1, 0, None, Some(landing), l.now).unwrap();
    l.send_c(h, &[], b"?");
    let Event::Request { landing: got, .. } = l.deliver_to_server().unwrap().ev else {
        panic!()
    };
    assert_eq!(got, Some(landing));
    assert_eq!(l.s.plan(3000, 0, Some(landing.len)), Transfer::Landing);
    assert_eq!(l.s.plan(4096, 0, Some(landing.len)), Transfer::Rendezvous);
    assert!(matches!(
        l.s.response(call, 3000, 0, None, false),
        Err(SendError::Invalid(_))
    ));
    assert!(matches!(
        l.s.response(call, 4090, 0, None, true),
        Err(SendError::Invalid(_))
    ));
    let h = l.s.response(call, 3000, 0, None, true).unwrap();
    assert!(h.flags.contains(FrameFlags::WRITTEN));
    let payload = vec![7u8; 3000];
    l.send_s(h, &[], &payload);
    let got = l.deliver_to_client().unwrap();
    assert_eq!(
        got.ev,
        Event::Response {
            call,
            bulk: None,
            written: true
        }
    );
    assert_eq!(got.payload.len(), 3000);

    // A written response for a call that offered no landing zone.
    let call = l.unary(b"", None);
    l.deliver_to_server().unwrap();
    assert_eq!(
        l.s.response(call, 10, 0, None, true),
        Err(SendError::BadState(
            "the request advertised no landing zone"
        ))
    );
    l.send_s(
        FrameHeader {
            flags: FrameFlags::WRITTEN,
            ..FrameHeader::new(FrameKind::Response, call.0)
        },
        &[],
        &[],
    );
    assert!(matches!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::Unexpected { .. }
    ));
    // Landing zones are for single responses.
    let s =
        l.c.start_call(M, CallKind::ServerStreaming, None, l.now)
            .unwrap();
    assert!(matches!(
        l.c.request(s, 0, 0, None, Some(landing), l.now),
        Err(SendError::Invalid(_))
    ));
}

#[test]
fn rendezvous_request() {
    let mut l = Link::new(cfg());
    assert_eq!(l.c.plan(100_000, 0, None), Transfer::Rendezvous);
    let bulk = BulkDesc {
        addr: 0x1_0000,
        len: 100_000,
        rkey: 77,
    };
    let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    assert!(matches!(
        l.c.request(call, 10, 0, Some(bulk), None, l.now),
        Err(SendError::Invalid(_))
    ));
    assert!(matches!(
        l.c.request(call, 2000, 0, None, None, l.now),
        Err(SendError::Invalid(_))
    ));
    let h = l.c.request(call, 0, 0, Some(bulk), None, l.now).unwrap();
    l.send_c(h, &[], &[]);
    let Event::Request { bulk: got, .. } = l.deliver_to_server().unwrap().ev else {
        panic!()
    };
    assert_eq!(got, Some(bulk));
    // The server READs, then releases, then answers.
    let h = l.s.bulk_release(call).unwrap();
    l.send_s(h, &[], &[]);
    assert_eq!(
        l.deliver_to_client().unwrap().ev,
        Event::BulkRelease { call }
    );
    // A bulk above max_message is a protocol error.
    let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    assert!(matches!(
        l.c.request(
            call,
            0,
            0,
            Some(BulkDesc {
                len: 2 << 20,
                ..bulk
            }),
            None,
            l.now
        ),
        Err(SendError::Invalid(_))
    ));
    l.send_c(
        FrameHeader {
            flags: FrameFlags::HAS_BULK | FrameFlags::END_STREAM,
            aux: M,
            bulk: Some(BulkDesc {
                len: 2 << 20,
                ..bulk
            }),
            ..FrameHeader::new(FrameKind::Request, call.0)
        },
        &[],
        &[],
    );
    assert!(matches!(
        l.deliver_to_server().unwrap_err(),
        ProtocolError::TooLarge { len, .. } if len == 2 << 20
    ));
}

/// A request whose payload is written while the server READs it: BulkReady frames grow to
/// the payload's length; anything else is refused on both sides.
#[test]
fn pending_rendezvous_request() {
    let mut l = Link::new(cfg());
    let bulk = BulkDesc {
        addr: 0x1_0000,
        len: 100_000,
        rkey: 77,
    };
    let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    // Not before the Request.
    assert!(matches!(
        l.c.bulk_ready(call, 10),
        Err(SendError::BadState(_))
    ));
    let h = l.c.request_pending(call, 0, bulk, None, l.now).unwrap();
    assert!(h.flags.contains(FrameFlags::BULK_PENDING));
    l.send_c(h, &[], &[]);
    let Event::Request {
        bulk: got, pending, ..
    } = l.deliver_to_server().unwrap().ev
    else {
        panic!()
    };
    assert_eq!((got, pending), (Some(bulk), true));
    // The client's own checks: it grows, within the payload.
    assert!(matches!(
        l.c.bulk_ready(call, 0),
        Err(SendError::Invalid(_))
    ));
    assert!(matches!(
        l.c.bulk_ready(call, 100_001),
        Err(SendError::Invalid(_))
    ));
    for ready in [40_000, 100_000] {
        let h = l.c.bulk_ready(call, ready).unwrap();
        l.send_c(h, &[], &[]);
        assert_eq!(
            l.deliver_to_server().unwrap().ev,
            Event::BulkReady { call, ready }
        );
    }
    assert!(matches!(
        l.c.bulk_ready(call, 100_000),
        Err(SendError::Invalid(_))
    ));
    // After the answer it is gone.
    let h = l.s.status(call, 0, 0, 0).unwrap();
    l.send_s(h, &[], &[]);
    l.deliver_to_client().unwrap();
    assert_eq!(l.c.bulk_ready(call, 100_000), Err(SendError::Gone));
    l.check();

    // A forged BulkReady: one that shrinks, one past the payload, one for a call whose
    // payload is not pending: the connection is closed with a reason.
    let forged = |ready: u64, pending: bool| {
        let mut l = Link::new(cfg());
        let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
        let h = if pending {
            l.c.request_pending(call, 0, bulk, None, l.now).unwrap()
        } else {
            l.c.request(call, 0, 0, Some(bulk), None, l.now).unwrap()
        };
        l.send_c(h, &[], &[]);
        l.deliver_to_server().unwrap();
        if pending {
            let h = l.c.bulk_ready(call, 50_000).unwrap();
            l.send_c(h, &[], &[]);
            l.deliver_to_server().unwrap();
        }
        l.send_c(
            FrameHeader {
                aux: ready as u32,
                seq: (ready >> 32) as u32,
                ..FrameHeader::new(FrameKind::BulkReady, call.0)
            },
            &[],
            &[],
        );
        l.deliver_to_server().unwrap_err().to_string()
    };
    assert!(forged(50_000, true).contains("does not grow"));
    assert!(forged(100_001, true).contains("beyond"));
    assert!(forged(1 << 40, true).contains("beyond"));
    assert!(forged(10, false).contains("not pending"));
}

/// A rendezvous request made of several remote ranges: the server sees them all, in order;
/// the limits apply to their total; malformed lists are refused before anything is sent.
#[test]
fn rendezvous_request_in_pieces() {
    let mut l = Link::new(cfg());
    let d = |addr, len, rkey| BulkDesc { addr, len, rkey };
    let pieces = [
        d(0x1000, 40, 1),
        d(0x7000_0000, 300_000, 2),
        d(0x1028, 8, 1),
    ];
    let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    for bad in [
        &[pieces[0], pieces[1], pieces[2], pieces[0]][..],
        &[pieces[0], d(0x2000, 0, 1)][..],
    ] {
        assert!(matches!(
            l.c.request_pieces(call, 0, 0, bad, None, l.now),
            Err(SendError::Invalid(_))
        ));
    }
    // The total counts against max_message (1 MiB), not each range.
    let over = [d(1, 600_000, 1), d(2, 600_000, 2)];
    assert!(matches!(
        l.c.request_pieces(call, 0, 0, &over, None, l.now),
        Err(SendError::Invalid(_))
    ));
    let h =
        l.c.request_pieces(call, 0, 3, &pieces, None, l.now)
            .unwrap();
    assert!(
        h.flags
            .contains(FrameFlags::HAS_BULK | FrameFlags::BULK_PIECES)
    );
    assert_eq!(h.bulk_len(), 300_048);
    l.send_c(h, b"k=v", &[]);
    let Event::Request {
        bulk, bulk_more, ..
    } = l.deliver_to_server().unwrap().ev
    else {
        panic!()
    };
    assert_eq!(bulk, Some(pieces[0]));
    assert_eq!(bulk_more.as_slice(), &pieces[1..]);
    // One BulkRelease gives all of them back.
    let h = l.s.bulk_release(call).unwrap();
    l.send_s(h, &[], &[]);
    assert_eq!(
        l.deliver_to_client().unwrap().ev,
        Event::BulkRelease { call }
    );
    // A forged request whose ranges are within the limit one by one but not together.
    let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    l.send_c(
        FrameHeader {
            flags: FrameFlags::HAS_BULK | FrameFlags::BULK_PIECES | FrameFlags::END_STREAM,
            aux: M,
            bulk: Some(over[0]),
            bulk_more: BulkMore::from_slice(&over[1..]).unwrap(),
            ..FrameHeader::new(FrameKind::Request, call.0)
        },
        &[],
        &[],
    );
    assert!(matches!(
        l.deliver_to_server().unwrap_err(),
        ProtocolError::TooLarge { len, .. } if len == 1_200_000
    ));
}

#[test]
fn plan_boundaries() {
    let c = Conn::new(Role::Client, cfg()).unwrap(); // eager 1024, max 1 MiB
    let s = Conn::new(Role::Server, cfg()).unwrap();
    let room = 1024 - MAX_HEADER_LEN as u64;
    assert_eq!(c.plan(0, 0, None), Transfer::Eager);
    assert_eq!(c.plan(room, 0, None), Transfer::Eager);
    assert_eq!(c.plan(room - 10, 10, None), Transfer::Eager);
    assert_eq!(c.plan(room - 10, 11, None), Transfer::Rendezvous);
    assert_eq!(c.plan(room + 1, 0, None), Transfer::Rendezvous);
    assert_eq!(
        c.plan(room + 1, 0, Some(1 << 20)),
        Transfer::Rendezvous,
        "clients never land"
    );
    assert_eq!(s.plan(room + 1, 0, Some(1 << 20)), Transfer::Landing);
    assert_eq!(s.plan(1 << 20, 0, Some(1 << 20)), Transfer::Rendezvous);
    assert_eq!(c.plan(1 << 20, 0, None), Transfer::Rendezvous);
    assert_eq!(c.plan((1 << 20) + 1, 0, None), Transfer::TooLarge);
    assert_eq!(
        c.plan(0, 1024, None),
        Transfer::TooLarge,
        "metadata must fit a slot"
    );
    assert_eq!(
        c.plan(u64::MAX, usize::MAX, Some(u64::MAX)),
        Transfer::TooLarge
    );
}

#[test]
fn protocol_violations() {
    let mut l = Link::new(cfg());
    // Wrong direction both ways.
    l.send_s(
        FrameHeader {
            flags: FrameFlags::END_STREAM,
            aux: M,
            ..FrameHeader::new(FrameKind::Request, CallId::new(0, 1).0)
        },
        &[],
        &[],
    );
    assert_eq!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::WrongDirection {
            kind: FrameKind::Request,
            role: Role::Client
        }
    );
    l.send_c(
        FrameHeader::new(FrameKind::Response, CallId::new(0, 1).0),
        &[],
        &[],
    );
    assert!(matches!(
        l.deliver_to_server().unwrap_err(),
        ProtocolError::WrongDirection { .. }
    ));
    // A response to a call never started, to one whose request is not sent, to one that is
    // over, and outside the table. (A fresh link for each case: forged frames upset the
    // credit balance of the one before.)
    let mut l = Link::new(cfg());
    l.send_s(
        FrameHeader::new(FrameKind::Response, CallId::new(3, 1).0),
        &[],
        &[],
    );
    assert!(matches!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::UnknownCall { .. }
    ));
    let idle = l.c.start_call(M, CallKind::Unary, None, 0).unwrap();
    l.send_s(FrameHeader::new(FrameKind::Status, idle.0), &[], &[]);
    assert!(matches!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::UnknownCall { .. }
    ));
    let mut l = Link::new(cfg());
    let idle = l.c.start_call(M, CallKind::Unary, None, 0).unwrap();
    let h = l.c.request(idle, 0, 0, None, None, 0).unwrap();
    l.send_c(h, &[], &[]);
    l.deliver_to_server().unwrap();
    let mut h = l.s.status(idle, 0, 0, 0).unwrap();
    h.credits = 0; // sent twice: return the credit once only
    l.send_s(h, &[], &[]);
    l.send_s(h, &[], &[]);
    assert!(l.deliver_to_client().is_ok());
    assert_eq!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::AfterEnd {
            call: idle,
            kind: FrameKind::Status
        }
    );
    l.send_s(
        FrameHeader::new(FrameKind::Status, CallId::new(8, 1).0),
        &[],
        &[],
    );
    assert_eq!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::BadCallId(CallId::new(8, 1).0)
    );
    // A duplicate request.
    let mut l = Link::new(cfg());
    let call = l.unary(b"", None);
    l.deliver_to_server().unwrap();
    let dup = FrameHeader {
        flags: FrameFlags::END_STREAM,
        aux: M,
        ..FrameHeader::new(FrameKind::Request, call.0)
    };
    l.send_c(dup, &[], &[]);
    assert_eq!(
        l.deliver_to_server().unwrap_err(),
        ProtocolError::DuplicateRequest(call)
    );
    // Credits beyond the ring depth.
    let mut l = Link::new(cfg());
    l.send_s(
        FrameHeader {
            credits: 100,
            ..FrameHeader::new(FrameKind::CreditUpdate, 0)
        },
        &[],
        &[],
    );
    assert!(matches!(
        l.deliver_to_client().unwrap_err(),
        ProtocolError::CreditOverflow { max: 8, .. }
    ));
    // Frames beyond the credits we gave.
    let mut l = Link::new(cfg());
    l.auto_repost = false;
    for _ in 0..9 {
        l.send_c(FrameHeader::new(FrameKind::CreditUpdate, 0), &[], &[]);
    }
    let errors: Vec<_> = (0..9).filter_map(|_| l.deliver_to_server().err()).collect();
    assert_eq!(errors, [ProtocolError::NoCredit]);
    // Every error message says what went wrong.
    let msg = ProtocolError::NoCredit.to_string();
    assert!(msg.contains("without a receive credit"), "{msg}");
}

#[test]
fn config_validation() {
    assert_eq!(Config::default().validate(), Ok(()));
    let bad = [
        Config {
            max_calls: 0,
            ..cfg()
        },
        Config {
            max_calls: MAX_CALLS + 1,
            ..cfg()
        },
        Config {
            peer_max_calls: 0,
            ..cfg()
        },
        Config {
            reserved_credits: 1,
            ..cfg()
        },
        Config {
            initial_send_credits: 3,
            max_send_credits: 3,
            ..cfg()
        },
        Config {
            recv_depth: 3,
            recv_max: 3,
            ..cfg()
        },
        Config {
            recv_depth: 70_000,
            recv_max: 70_000,
            ..cfg()
        },
        Config {
            max_send_credits: 7,
            ..cfg()
        },
        Config {
            recv_max: 7,
            ..cfg()
        },
        Config {
            recv_max: 70_000,
            ..cfg()
        },
        Config {
            credit_update_threshold: 1,
            ..cfg()
        },
        Config {
            credit_update_threshold: 9,
            ..cfg()
        },
        Config {
            eager_limit: 100,
            ..cfg()
        },
        Config {
            max_message: 100,
            ..cfg()
        },
        Config {
            stream_window: 0,
            ..cfg()
        },
    ];
    for c in bad {
        let e = c.validate().unwrap_err();
        assert!(matches!(e, WireError::InvalidConfig(_)), "{c:?}");
        assert!(Conn::new(Role::Client, c).is_err());
        assert!(e.to_string().starts_with("invalid wire config: "));
    }
}

/// One step of the random interleaving.
#[derive(Clone, Debug)]
enum Op {
    /// Start a unary call and send its request when credits allow.
    Call(u8),
    /// Deliver the next frame to the server / client.
    ToServer,
    ToClient,
    /// The server answers its `n`-th pending call (Response or error Status).
    Answer(u8, bool),
    /// Re-post some receive slots the application held (server / client); 255: all.
    RepostServer(u8),
    RepostClient(u8),
    /// Send a CreditUpdate if the side wants one.
    CreditUpdates,
    /// Give up the `n`-th pending client call.
    Cancel(u8),
    /// Advance the clock and expire.
    Tick(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => any::<u8>().prop_map(Op::Call),
        4 => Just(Op::ToServer),
        4 => Just(Op::ToClient),
        3 => (any::<u8>(), any::<bool>()).prop_map(|(n, ok)| Op::Answer(n, ok)),
        2 => any::<u8>().prop_map(Op::RepostServer),
        2 => any::<u8>().prop_map(Op::RepostClient),
        2 => Just(Op::CreditUpdates),
        1 => any::<u8>().prop_map(Op::Cancel),
        1 => any::<u16>().prop_map(Op::Tick),
    ]
}

/// The runtime's side of the random test: what it holds.
struct Model {
    l: Link,
    /// Client calls started and not finished, with whether their request was sent (or needs
    /// no sending any more).
    client_calls: Vec<(CallId, bool)>,
    /// Client calls given up whose Cancel still waits for a credit.
    cancels: Vec<CallId>,
    /// Calls the server has open.
    server_calls: Vec<CallId>,
    /// Receive slots each side's application holds.
    held_s: u32,
    held_c: u32,
    completed: u32,
}

impl Model {
    fn new() -> Model {
        let mut l = Link::new(Config {
            max_calls: 6,
            peer_max_calls: 6,
            initial_send_credits: 5,
            max_send_credits: 5,
            recv_depth: 5,
            recv_max: 5,
            reserved_credits: 2,
            credit_update_threshold: 3,
            ..cfg()
        });
        l.auto_repost = false;
        Model {
            l,
            client_calls: Vec::new(),
            cancels: Vec::new(),
            server_calls: Vec::new(),
            held_s: 0,
            held_c: 0,
            completed: 0,
        }
    }

    fn send_pending_requests(&mut self) {
        while let Some(&call) = self.cancels.first() {
            match self.l.c.cancel(call) {
                Ok(h) => {
                    self.l.send_c(h, &[], &[]);
                    self.cancels.remove(0);
                    assert!(self.l.c.finish(call));
                    self.completed += 1;
                }
                Err(SendError::NoCredit) => break,
                Err(e) => panic!("cancel: {e}"),
            }
        }
        let mut i = 0;
        while i < self.client_calls.len() {
            let (call, sent) = self.client_calls[i];
            if !sent {
                match self.l.c.request(call, 1, 0, None, None, self.l.now) {
                    Ok(h) => {
                        self.l.send_c(h, &[], b"r");
                        self.client_calls[i].1 = true;
                    }
                    Err(SendError::NoCredit) => break,
                    Err(SendError::Expired) => {
                        // Failed with DEADLINE_EXCEEDED before it went out.
                        assert!(self.l.c.finish(call));
                        self.client_calls.remove(i);
                        self.completed += 1;
                        continue;
                    }
                    Err(e) => panic!("request: {e}"),
                }
            }
            i += 1;
        }
    }

    fn deliver_server(&mut self) {
        if self.l.to_s.is_empty() {
            return;
        }
        let got = self
            .l
            .deliver_to_server()
            .expect("no protocol error in a correct exchange");
        self.held_s += 1;
        match got.ev {
            Event::Request { call, replaced, .. } => {
                if let Some(r) = replaced {
                    self.server_calls.retain(|&c| c != r);
                }
                self.server_calls.push(call);
            }
            Event::Cancel { call } => {
                self.server_calls.retain(|&c| c != call);
                self.l.s.finish(call);
            }
            Event::CreditOnly | Event::Stale { .. } => {}
            ev => panic!("server got {ev:?}"),
        }
    }

    fn deliver_client(&mut self) {
        if self.l.to_c.is_empty() {
            return;
        }
        let got = self
            .l
            .deliver_to_client()
            .expect("no protocol error in a correct exchange");
        self.held_c += 1;
        match got.ev {
            Event::Response { call, .. } | Event::Status { call, .. } => {
                assert!(self.l.c.finish(call));
                self.client_calls.retain(|&(c, _)| c != call);
                self.completed += 1;
            }
            Event::CreditOnly | Event::Stale { .. } => {}
            ev => panic!("client got {ev:?}"),
        }
    }

    fn step(&mut self, op: Op) {
        match op {
            Op::Call(t) => {
                let timeout = (t % 4 == 0).then_some(u64::from(t) * 10);
                if let Ok(call) = self.l.c.start_call(M, CallKind::Unary, timeout, self.l.now) {
                    self.client_calls.push((call, false));
                }
            }
            Op::ToServer => self.deliver_server(),
            Op::ToClient => self.deliver_client(),
            Op::Answer(n, ok) => {
                if !self.server_calls.is_empty() {
                    let call = self.server_calls[usize::from(n) % self.server_calls.len()];
                    let r = if ok {
                        self.l.s.response(call, 1, 0, None, false)
                    } else {
                        self.l.s.status(call, 2, 3, 0)
                    };
                    match r {
                        Ok(h) => {
                            let payload: &[u8] = if ok { b"a" } else { b"err" };
                            self.l.send_s(h, &[], payload);
                            self.l.s.finish(call);
                            self.server_calls.retain(|&c| c != call);
                        }
                        Err(SendError::NoCredit) => {}
                        Err(SendError::Gone) => {
                            self.l.s.finish(call);
                            self.server_calls.retain(|&c| c != call);
                        }
                        Err(e) => panic!("answer: {e}"),
                    }
                }
            }
            Op::RepostServer(n) => {
                let n = if n == u8::MAX {
                    self.held_s
                } else {
                    u32::from(n) % (self.held_s + 1)
                };
                self.l.s.recv_reposted(n).unwrap();
                self.held_s -= n;
            }
            Op::RepostClient(n) => {
                let n = if n == u8::MAX {
                    self.held_c
                } else {
                    u32::from(n) % (self.held_c + 1)
                };
                self.l.c.recv_reposted(n).unwrap();
                self.held_c -= n;
            }
            Op::CreditUpdates => {
                if self.l.c.wants_credit_update()
                    && let Ok(h) = self.l.c.credit_update()
                {
                    self.l.send_c(h, &[], &[]);
                }
                if self.l.s.wants_credit_update()
                    && let Ok(h) = self.l.s.credit_update()
                {
                    self.l.send_s(h, &[], &[]);
                }
            }
            Op::Cancel(n) => {
                if !self.client_calls.is_empty() {
                    let i = usize::from(n) % self.client_calls.len();
                    let (call, _) = self.client_calls[i];
                    if self.l.c.cancel_local(call) {
                        self.client_calls.remove(i);
                        self.cancels.push(call);
                    } else {
                        // Never sent, or already expired and told: just drop it.
                        self.l.c.finish(call);
                        self.client_calls.remove(i);
                        self.completed += 1;
                    }
                }
            }
            Op::Tick(dt) => {
                self.l.now += u64::from(dt);
                while let Some(call) = self.l.c.expire(self.l.now) {
                    // The runtime fails the call; it may leave the Cancel out (takeover).
                    self.l.c.finish(call);
                    self.client_calls.retain(|&(c, _)| c != call);
                    self.completed += 1;
                }
                while let Some(call) = self.l.s.expire(self.l.now) {
                    self.l.s.finish(call);
                    self.server_calls.retain(|&c| c != call);
                }
            }
        }
        self.send_pending_requests();
        self.invariants();
    }

    fn invariants(&self) {
        self.l.check();
        for conn in [&self.l.c, &self.l.s] {
            assert!(conn.send_credits() <= 5, "credits above the ring depth");
        }
        // In-flight frames never exceed what the receiver has slots for.
        assert!(self.l.to_s.len() as u32 + self.held_s <= 5);
        assert!(self.l.to_c.len() as u32 + self.held_c <= 5);
    }

    /// Lets everything finish: a live protocol completes every call.
    fn drain(&mut self) {
        for _ in 0..10_000 {
            if self.client_calls.is_empty()
                && self.cancels.is_empty()
                && self.l.to_s.is_empty()
                && self.l.to_c.is_empty()
            {
                break;
            }
            self.step(Op::RepostServer(255));
            self.step(Op::RepostClient(255));
            self.step(Op::CreditUpdates);
            self.step(Op::ToServer);
            self.step(Op::Answer(0, true));
            self.step(Op::ToClient);
        }
        assert!(
            self.client_calls.is_empty() && self.cancels.is_empty(),
            "calls stuck: {:?}, client {:?}, server {:?}",
            self.client_calls,
            self.l.c,
            self.l.s,
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Random interleavings of calls, deliveries, held slots, answers, cancels and timeouts:
    /// no protocol error, credits within [0, ring depth], no frame without a receive slot,
    /// every internal invariant, and in the end every call completes.
    #[test]
    fn random_interleavings_keep_credits_and_complete(
        ops in proptest::collection::vec(op(), 0..300)
    ) {
        let mut m = Model::new();
        let mut started = 0;
        for op in ops {
            if matches!(op, Op::Call(_)) {
                started += 1;
            }
            m.step(op);
        }
        m.drain();
        prop_assert!(m.completed <= started);
        prop_assert_eq!(m.l.c.calls_in_flight(), 0);
    }

    /// The `frame_decode` fuzz target over arbitrary bytes.
    #[test]
    fn fuzz_frame_decode_random_bytes(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        fuzz::frame_decode(&data);
    }

    /// The `frame_decode` fuzz target over valid frames with a few bytes changed.
    #[test]
    fn fuzz_frame_decode_mutated_frames(
        h in super::frame::tests::arb_valid_header(),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..4),
        extra in 0usize..64,
    ) {
        let mut h = h;
        h.metadata_len %= 16;
        if h.bulk.is_none() && h.payload_len != 0 {
            h.payload_len %= 32;
            h.payload_len = h.payload_len.max(1);
        }
        let md = vec![1u8; usize::from(h.metadata_len)];
        let pl = vec![2u8; h.payload_len as usize];
        let mut buf = encode(&h, &md, &pl);
        buf.resize(buf.len() + extra, 0);
        for (i, b) in flips {
            let n = buf.len();
            buf[i % n] ^= b;
        }
        fuzz::frame_decode(&buf);
    }

    /// The `frame_decode` fuzz target over batches of valid frames (MORE on all but the
    /// last) with a few bytes changed, cut short or extended.
    #[test]
    fn fuzz_frame_decode_mutated_batches(
        hs in proptest::collection::vec(super::frame::tests::arb_valid_header(), 1..5),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
        cut in 0usize..8,
        extra in 0usize..8,
    ) {
        let mut buf = Vec::new();
        let n = hs.len();
        for (i, mut h) in hs.into_iter().enumerate() {
            h.flags = h.flags.with(FrameFlags::WRITTEN, false);
            h.metadata_len %= 8;
            h.payload_len %= 16;
            let md = vec![3u8; usize::from(h.metadata_len)];
            let pl = vec![4u8; h.payload_len as usize];
            let at = buf.len();
            buf.extend_from_slice(&encode(&h, &md, &pl));
            if i + 1 < n {
                mark_more(&mut buf[at..]).unwrap();
            }
        }
        // Unchanged, the batch decodes to its end.
        prop_assert_eq!(Batch::new(&buf).filter(|r| r.is_ok()).count(), n);
        for (i, b) in flips {
            let len = buf.len();
            buf[i % len] ^= b;
        }
        buf.truncate(buf.len().saturating_sub(cut));
        buf.resize(buf.len() + extra, 0);
        fuzz::frame_decode(&buf);
    }

    /// The `metadata_decode` fuzz target over joined blocks (headers, separator, trailers)
    /// with a few bytes changed.
    #[test]
    fn fuzz_metadata_decode_mutated_blocks(
        headers in proptest::collection::vec(("[a-z]{1,6}", "[ -~]{0,8}"), 0..4),
        trailers in proptest::collection::vec(("[a-z]{1,6}", "[ -~]{0,8}"), 0..4),
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
    ) {
        let section = |kv: &[(String, String)]| {
            let mut md = crate::Metadata::new();
            for (k, v) in kv {
                md.insert(k.clone(), v.clone()).unwrap();
            }
            md
        };
        let md = crate::Metadata::join(section(&headers), section(&trailers)).unwrap();
        let mut buf = vec![0u8; md.encoded_len()];
        md.encode(&mut buf);
        let (h, t) = crate::Metadata::decode_sections(&buf).unwrap();
        prop_assert_eq!(h, section(&headers));
        prop_assert_eq!(t, Some(section(&trailers)));
        for (i, b) in flips {
            let n = buf.len();
            buf[i % n] ^= b;
        }
        fuzz::metadata_decode(&buf);
    }

    /// The `conn_events` fuzz target over arbitrary operation streams.
    #[test]
    fn fuzz_conn_events(data in proptest::collection::vec(any::<u8>(), 0..2000)) {
        fuzz::conn_events(&data);
    }
}

/// Frames built while [`Conn::set_joining`] is on go in the SEND before them: the sender
/// spends one credit for the whole batch, the receiver counts one receive slot for it.
#[test]
fn a_batch_spends_one_credit_and_fills_one_slot() {
    let (mut l, call) = server_stream(8, 8);
    let credits = l.s.send_credits();
    // Five stream messages and the final status in one SEND: the first takes a credit, the
    // others join it.
    let mut send = Vec::new();
    for i in 0..5u8 {
        l.s.set_joining(i > 0);
        let h = l.s.stream_message(call, 1, 0, None).unwrap();
        l.s.set_joining(false);
        if !send.is_empty() {
            let last: &mut Vec<u8> = &mut send;
            let at = last.len() - (BASE_HEADER_LEN + 1);
            mark_more(&mut last[at..]).unwrap();
        }
        send.extend_from_slice(&encode(&h, &[], &[i]));
    }
    assert_eq!(l.s.send_credits(), credits - 1, "one credit for the SEND");
    l.s.set_joining(true);
    let h = l.s.status(call, 0, 0, 0).unwrap();
    l.s.set_joining(false);
    assert_eq!(l.s.send_credits(), credits - 1);
    let at = send.len() - (BASE_HEADER_LEN + 1);
    mark_more(&mut send[at..]).unwrap();
    send.extend_from_slice(&encode(&h, &[], &[]));

    // The client: six frames, one slot.
    let mut got = Vec::new();
    for r in Batch::new(&send) {
        let (_, f) = r.unwrap();
        got.push(l.c.handle_frame(&f.header, l.now).unwrap());
    }
    assert_eq!(got.len(), 6);
    for (i, ev) in got[..5].iter().enumerate() {
        assert_eq!(
            *ev,
            Event::StreamMessage {
                call,
                seq: i as u32,
                bulk: None,
                packed: 0
            }
        );
    }
    assert_eq!(got[5], Event::Status { call, code: 0 });
    // One slot to re-post, not six.
    assert!(l.c.recv_reposted(2).is_err(), "one slot was filled");
    l.c.recv_reposted(1).unwrap();
    l.check();
}

/// A frame after a batch's last one fills a new slot: the receiver's count goes back to one
/// slot per SEND, and a peer that sends past its credits by batching wrongly is caught.
#[test]
fn batch_accounting_resumes_after_the_last_frame() {
    let mut l = Link::new(cfg()); // recv_depth = 8
    l.auto_repost = false;
    let mut more = FrameHeader::new(FrameKind::CreditUpdate, 0);
    more.flags = FrameFlags::MORE;
    let last = FrameHeader::new(FrameKind::CreditUpdate, 0);
    // Eight SENDs of two frames each use all eight slots the client posted for the server.
    for _ in 0..8 {
        l.c.handle_frame(&more, l.now).unwrap();
        l.c.handle_frame(&last, l.now).unwrap();
    }
    assert_eq!(
        l.c.handle_frame(&last, l.now),
        Err(ProtocolError::NoCredit),
        "a ninth SEND had no slot"
    );
    l.c.recv_reposted(8).unwrap();
    l.check();
}

/// A server granting from a shared pool: windows start at 4 and may grow to 16.
fn pool_cfg() -> Config {
    Config {
        max_calls: 16,
        peer_max_calls: 16,
        initial_send_credits: 4,
        max_send_credits: 16,
        recv_depth: 4,
        recv_max: 16,
        ..cfg()
    }
}

#[test]
fn grants_grow_the_window_up_to_recv_max() {
    let mut l = Link::new(pool_cfg());
    assert_eq!((l.s.window(), l.c.send_credits()), (4, 4));
    assert_eq!(l.s.grant(5), 5);
    assert_eq!(l.s.window(), 9);
    assert_eq!(
        l.s.owed_credits(),
        5,
        "granted credits ride like reposted ones"
    );
    assert_eq!(l.s.grant(100), 7, "never above recv_max");
    assert_eq!(l.s.grant(1), 0);
    let h = l.s.credit_update().unwrap();
    assert_eq!(h.credits, 12);
    l.send_s(h, &[], &[]);
    assert_eq!(l.deliver_to_client().unwrap().ev, Event::CreditOnly);
    assert_eq!(l.c.send_credits(), 16);
    assert_eq!(l.s.peer_credits(), 16);
    l.check();
    // Sixteen credits: fourteen data frames in flight (two are the reserve).
    let calls: Vec<CallId> = (0..14).map(|i| l.unary(&[i], None)).collect();
    assert_eq!(l.c.data_credits(), 0);
    for _ in &calls {
        l.deliver_to_server().unwrap();
    }
    l.check();
}

#[test]
fn a_withheld_slot_shrinks_the_window_not_below_the_reserve() {
    let mut l = Link::new(pool_cfg());
    l.auto_repost = false;
    l.s.grant(4);
    let h = l.s.credit_update().unwrap();
    l.send_s(h, &[], &[]);
    l.deliver_to_client().unwrap();
    let a = l.unary(b"a", None);
    let b = l.unary(b"b", None);
    l.deliver_to_server().unwrap();
    l.deliver_to_server().unwrap();
    assert_eq!(l.s.window(), 8);
    // One slot goes back to the pool, one to the client.
    l.s.recv_withheld(1).unwrap();
    l.s.recv_reposted(1).unwrap();
    assert_eq!((l.s.window(), l.s.owed_credits()), (7, 1));
    assert!(
        l.s.recv_withheld(1).is_err(),
        "no frame left whose slot is not back"
    );
    l.check();
    for call in [a, b] {
        let h = l.s.status(call, 0, 0, 0).unwrap();
        l.send_s(h, &[], &[]);
        l.deliver_to_client().unwrap();
        l.c.finish(call);
        l.s.finish(call);
    }
    assert_eq!(l.c.send_credits(), 7, "the client holds the whole window");
    // Down to the reserve + 2, never below.
    let calls: Vec<CallId> = (0..5).map(|i| l.unary(&[i], None)).collect();
    for _ in &calls {
        l.deliver_to_server().unwrap();
    }
    l.s.recv_withheld(3).unwrap();
    assert_eq!(l.s.window(), 4);
    assert_eq!(
        l.s.recv_withheld(1),
        Err(SendError::Invalid(
            "a window below reserved_credits + 2 could stall the peer"
        ))
    );
    l.check();
}

#[test]
fn reclaim_takes_back_unused_credits_exactly() {
    let mut l = Link::new(pool_cfg());
    l.s.grant(12);
    let h = l.s.credit_update().unwrap();
    l.send_s(h, &[], &[]);
    l.deliver_to_client().unwrap();
    assert_eq!(l.c.send_credits(), 16);
    // The client sends a request the server has not seen when it asks for credits back.
    let call = l.unary(b"x", None);
    let h = l.s.reclaim(4).unwrap();
    assert!(h.flags.contains(FrameFlags::RECLAIM));
    assert_eq!(h.aux, 4);
    assert!(l.s.is_reclaiming());
    assert_eq!(
        l.s.reclaim(4),
        Err(SendError::BadState(
            "a reclaim already waits for its answer"
        ))
    );
    l.send_s(h, &[], &[]);
    // The request arrives first (its slot goes back to the client as usual).
    l.deliver_to_server().unwrap();
    // The reclaim reaches the client: 16 - 1 (the request) - 1 (the reclaim's own credit
    // costs the server, not the client) = 15 credits, keep 4, give 11 back.
    assert_eq!(l.deliver_to_client().unwrap().ev, Event::CreditOnly);
    assert_eq!(l.c.send_credits(), 4);
    assert!(l.c.wants_credit_update(), "the answer is due");
    let h = l.c.credit_update().unwrap();
    assert!(h.flags.contains(FrameFlags::RECLAIM));
    assert_eq!(h.aux, 11);
    l.send_c(h, &[], &[]);
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::Surrendered { credits: 11 }
    );
    assert!(!l.s.is_reclaiming());
    assert_eq!(l.s.window(), 5, "the client's 3 + the 2 owed back to it");
    l.check();
    // The call still finishes.
    let h = l.s.response(call, 1, 0, None, false).unwrap();
    l.send_s(h, &[], b"y");
    assert!(matches!(
        l.deliver_to_client().unwrap().ev,
        Event::Response { .. }
    ));
    l.check();
}

#[test]
fn a_client_with_fewer_credits_than_asked_keeps_them() {
    let mut l = Link::new(pool_cfg());
    let h = l.s.reclaim(6).unwrap();
    l.send_s(h, &[], &[]);
    l.deliver_to_client().unwrap();
    assert_eq!(l.c.send_credits(), 4);
    let h = l.c.credit_update().unwrap();
    assert_eq!(h.aux, 0, "nothing given back");
    l.send_c(h, &[], &[]);
    assert_eq!(
        l.deliver_to_server().unwrap().ev,
        Event::Surrendered { credits: 0 }
    );
    l.check();
}

#[test]
fn reclaims_the_protocol_does_not_allow_close_the_connection() {
    // A client answering a reclaim nobody sent.
    let mut l = Link::new(pool_cfg());
    let mut h = FrameHeader::new(FrameKind::CreditUpdate, 0);
    h.flags |= FrameFlags::RECLAIM;
    h.aux = 1;
    l.send_c(h, &[], &[]);
    assert!(matches!(
        l.deliver_to_server(),
        Err(ProtocolError::Reclaim(_))
    ));
    // A client giving back more than it holds.
    let mut l = Link::new(pool_cfg());
    let h = l.s.reclaim(4).unwrap();
    l.send_s(h, &[], &[]);
    l.deliver_to_client().unwrap();
    let mut h = FrameHeader::new(FrameKind::CreditUpdate, 0);
    h.flags |= FrameFlags::RECLAIM;
    h.aux = 9;
    l.send_c(h, &[], &[]);
    assert!(matches!(
        l.deliver_to_server(),
        Err(ProtocolError::Reclaim(_))
    ));
    // A server asking a client to keep less than the reserve needs.
    let mut l = Link::new(pool_cfg());
    assert!(l.s.reclaim(3).is_err(), "the builder refuses it");
    let mut h = FrameHeader::new(FrameKind::CreditUpdate, 0);
    h.flags |= FrameFlags::RECLAIM;
    h.aux = 3;
    l.send_s(h, &[], &[]);
    assert!(matches!(
        l.deliver_to_client(),
        Err(ProtocolError::Reclaim(_))
    ));
    // RECLAIM on another kind, or aux on a plain CreditUpdate, does not decode.
    let mut h = FrameHeader::new(FrameKind::GoAway, 0);
    h.flags |= FrameFlags::RECLAIM;
    assert!(h.check().is_err());
    let mut h = FrameHeader::new(FrameKind::CreditUpdate, 0);
    h.aux = 2;
    assert!(h.check().is_err());
    // Only a server reclaims.
    let mut l = Link::new(pool_cfg());
    assert!(l.c.reclaim(4).is_err());
}

#[test]
fn a_client_out_of_credits_says_so_on_its_next_frame() {
    let mut l = Link::new(pool_cfg());
    l.auto_repost = false;
    let a = l.unary(b"a", None);
    let _b = l.unary(b"b", None);
    let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    assert_eq!(
        l.c.request(call, 1, 0, None, None, l.now),
        Err(SendError::NoCredit),
        "two data credits of four"
    );
    // Whatever frame comes next (here a control frame, from the reserve) carries the flag.
    let h = l.c.bulk_release(a).unwrap();
    assert!(h.flags.contains(FrameFlags::STARVED), "{h:?}");
    l.send_c(h, &[], &[]);
    l.deliver_to_server().unwrap();
    l.deliver_to_server().unwrap();
    assert!(
        !l.s.take_peer_starved(),
        "the requests went out before it ran out"
    );
    let _ = l.deliver_to_server();
    assert!(l.s.take_peer_starved());
    assert!(!l.s.take_peer_starved(), "taken once");
    l.s.grant(4);
    let h = l.s.credit_update().unwrap();
    l.send_s(h, &[], &[]);
    l.deliver_to_client().unwrap();
    let call = l.c.start_call(M, CallKind::Unary, None, l.now).unwrap();
    let h = l.c.request(call, 1, 0, None, None, l.now).unwrap();
    assert!(!h.flags.contains(FrameFlags::STARVED), "said once");
}
