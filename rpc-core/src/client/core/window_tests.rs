//! Client receive windows at the RPC layer: one that cannot grow (registering its next
//! region fails, as with RLIMIT_MEMLOCK reached) keeps the window it has, and calls that need
//! more wait for credits instead of failing or losing anything; one that grew for a burst
//! gives its regions back after a quiet spell, never from under data a user keeps, and grows
//! again for the next burst.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use bytes::Bytes;

use std::sync::Arc;

use crate::client::rogue_tests::Blob;
use crate::client::{AnyCore, Channel, ClientPoller};
use crate::verbs::soft::Soft;

use super::ClientCore;
use crate::server::{Dispatched, IncomingCall, Server, Service};
use crate::{CallKind, Geometry, MethodDesc, Request, Response};

/// A call's number: its own in the low 32 bits, the length of its answer in the next 16,
/// and [`SLOW`] when the server waits 20 ms and more before it answers.
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Num {
    #[prost(uint64, tag = "1")]
    pub(super) seq: u64,
}

pub(super) const SLOW: u64 = 1 << 63;

pub(super) static BLOB: MethodDesc = MethodDesc::new("/window.Blobs/Blob", CallKind::Unary);
static METHODS: [MethodDesc; 1] = [BLOB];

/// Answers each call with the bytes its number asks for, all equal to its low byte.
struct Blobs;

impl Service for Blobs {
    fn name(&self) -> &'static str {
        "window.Blobs"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, _method: u32, call: IncomingCall<'_>) -> Dispatched {
        call.unary(|req: Request<Num>| async move {
            let seq = req.into_inner().seq;
            if seq & SLOW != 0 {
                // A millisecond apart, so that the answers go one per SEND, not packed.
                let ms = 20 + u64::from(seq as u32 % 64);
                tokio::time::sleep(Duration::from_millis(ms)).await;
            }
            Ok(Response::new(Blob {
                seq,
                data: Bytes::from(vec![seq as u8; (seq >> 32) as u16 as usize]),
            }))
        })
    }
}

pub(super) async fn call(ch: Channel, seq: u64) -> Blob {
    let mut req = Request::new(Num { seq });
    req.set_timeout(Duration::from_secs(30));
    let r = tokio::time::timeout(Duration::from_secs(60), ch.unary::<Num, Blob>(&BLOB, req))
        .await
        .expect("an answer in 60 s")
        .unwrap_or_else(|s| panic!("call {seq:#x}: {s}"))
        .into_inner();
    assert_eq!(r.seq, seq);
    assert_eq!(r.data.len(), (seq >> 32) as u16 as usize);
    assert!(r.data.iter().all(|&b| b == seq as u8));
    r
}

/// `n` slow calls at once, each answering `len` bytes; their answers. All are in flight
/// together (the first answer comes after 20 ms).
pub(super) async fn slow_calls(ch: &Channel, from: u32, n: u32, len: u16) -> Vec<Blob> {
    let calls = (from..from + n).map(|i| {
        let seq = SLOW | u64::from(len) << 32 | u64::from(i);
        tokio::spawn(call(ch.clone(), seq))
    });
    futures_util::future::join_all(calls)
        .await
        .into_iter()
        .map(|r| r.expect("the call's task"))
        .collect()
}

/// One small call after another for `d`.
async fn calls_for(ch: &Channel, d: Duration) {
    let start = Instant::now();
    let mut i = 0u64;
    while start.elapsed() < d {
        call(ch.clone(), 16 << 32 | i).await;
        i += 1;
    }
}

/// One small call after another until the window is `to` slots (at most 30 s); how long
/// that took.
async fn calls_until_window(ch: &Channel, to: u64) -> Duration {
    let start = Instant::now();
    let mut i = 0u64;
    while ch.slots().recv_window != to {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "the window did not come to {to} slots in 30 s: {:?}",
            ch.slots()
        );
        call(ch.clone(), 16 << 32 | i).await;
        i += 1;
    }
    start.elapsed()
}

/// The soft provider's core of the channel's connection (`None` on another provider).
#[allow(irrefutable_let_patterns)] // refutable with the ibverbs feature
pub(super) fn soft_core(ch: &Channel) -> Option<Arc<ClientCore<Soft>>> {
    let conn = ch.current().expect("a connection");
    let AnyCore::Soft(core) = &conn.core else {
        return None;
    };
    Some(Arc::clone(core))
}

pub(super) async fn server() -> (crate::server::RunningServer, String) {
    let server = Server::builder()
        .add_service(Blobs)
        .bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = server.local_addr().to_string();
    (server, addr)
}

pub(super) async fn connect(addr: &str, poller: ClientPoller) -> Channel {
    Channel::builder(addr)
        .poller(poller)
        .geometry(Geometry {
            recv_slots: 64,
            ..Geometry::default()
        })
        .connect()
        .await
        .expect("connect")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_that_cannot_grow_keeps_serving_its_calls() {
    let (_server, addr) = server().await;
    for poller in [ClientPoller::Thread, ClientPoller::Caller] {
        let stuck = connect(&addr, poller).await;
        let grows = connect(&addr, poller).await;
        let Some(core) = soft_core(&stuck) else {
            println!("skipped: the test's fault hook is in the soft provider's arena");
            return;
        };
        assert_eq!(stuck.slots().recv_window, 8, "{poller:?}");
        core.arena.refuse_growth();
        // 48 calls at once: far more than the 6 credits of a window of 8 (2 kept for
        // control frames). The server waits for credits as slots come back.
        slow_calls(&stuck, 0, 48, 0).await;
        slow_calls(&grows, 0, 48, 0).await;
        assert_eq!(stuck.slots().recv_window, 8, "{poller:?}: never grew");
        assert!(
            grows.slots().recv_window >= 32,
            "{poller:?}: the same calls grow a window that can: {:?}",
            grows.slots()
        );
        // Still whole: more calls, and one at a time.
        slow_calls(&stuck, 100, 24, 0).await;
        calls_for(&stuck, Duration::from_millis(50)).await;
        assert_eq!(stuck.slots().recv_window, 8);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_shrinks_after_its_burst_never_under_kept_data() {
    let (_server, addr) = server().await;
    for poller in [ClientPoller::Thread, ClientPoller::Caller] {
        let ch = connect(&addr, poller).await;
        let Some(core) = soft_core(&ch) else {
            println!("skipped: the test finds slots in the soft provider's arena");
            return;
        };
        // A burst whose 1 KiB answers borrow their receive slots (up to the lending budget).
        let burst = slow_calls(&ch, 0, 48, 1024).await;
        let grown = ch.slots().recv_window;
        assert!(grown >= 32, "{poller:?}: {:?}", ch.slots());
        // Keep two answers that lie in slots the window would give back (16 and up: past
        // what the calls one at a time below need), drop the others.
        let kept: Vec<Blob> = burst
            .into_iter()
            .filter(|b| {
                core.arena
                    .slot_holding(b.data.as_ptr())
                    .is_some_and(|s| s >= 16)
            })
            .take(2)
            .collect();
        assert_eq!(kept.len(), 2, "{poller:?}: answers kept in the upper slots");
        // Calls one at a time: after a quiet spell (a second at least) the window retires
        // what they do not need, but waits for the kept slots, which stay whole.
        let start = Instant::now();
        let retiring = || {
            core.driver
                .try_lock()
                .and_then(|d| d.link.recv_retiring_to())
        };
        while retiring().is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "{poller:?}: no retiring"
            );
            calls_for(&ch, Duration::from_millis(10)).await;
        }
        assert!(
            start.elapsed() >= Duration::from_secs(1),
            "{poller:?}: {:?}",
            start.elapsed()
        );
        calls_for(&ch, Duration::from_millis(200)).await;
        assert_eq!(
            ch.slots().recv_window,
            grown,
            "{poller:?}: not under kept data"
        );
        // A burst while it retires: the slots parked so far serve again.
        slow_calls(&ch, 500, 48, 0).await;
        assert_eq!(retiring(), None, "{poller:?}: the burst ended the retiring");
        assert_eq!(ch.slots().recv_window, grown);
        for b in &kept {
            assert!(b.data.iter().all(|&x| x == b.seq as u8), "{poller:?}");
        }
        drop(kept);
        // Once they are back, it shrinks to the 8 slots it started with.
        calls_until_window(&ch, 8).await;
        // And grows again for the next burst.
        slow_calls(&ch, 1000, 48, 0).await;
        assert!(ch.slots().recv_window >= 32, "{poller:?}: {:?}", ch.slots());
        // A quiet spell shorter than a second keeps it.
        calls_for(&ch, Duration::from_millis(300)).await;
        assert!(ch.slots().recv_window >= 32, "{poller:?}: {:?}", ch.slots());
    }
}
