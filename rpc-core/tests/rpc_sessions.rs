//! Many connections from one process: they share the process's device context, so a new
//! `Channel` costs a QP and small state, not a device and a thread (issue 14). Runs on every
//! provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{TestServer, echo_seq, threads, within};
use rpc_core::ClientPoller;

const CHANNELS: usize = 24;

/// Held by the tests that open a hundred connections or more: one at a time, they stay within
/// a 1024-descriptor limit (the Soft-RoCE VM's; each connection takes a few on each side).
static MANY: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Channels add no thread each, whoever polls them: the device context (and, on soft, its
/// service thread) is opened once per process, and `ClientPoller::Thread` channels share the
/// process's poller thread.
async fn channels_add_no_threads(mode: ClientPoller) {
    let srv = TestServer::start().await;
    let first = srv.channel(mode).await;
    echo_seq(&first, 0).await;
    let before = threads();
    let mut more = Vec::new();
    for i in 0..CHANNELS {
        let ch = srv.channel(mode).await;
        echo_seq(&ch, i as u64 + 1).await;
        more.push(ch);
    }
    // Every channel still works, in any order, and all at once.
    for (i, ch) in more.iter().enumerate().rev() {
        echo_seq(ch, 100 + i as u64).await;
    }
    let all = more
        .iter()
        .enumerate()
        .map(|(i, ch)| echo_seq(ch, 200 + i as u64));
    within(
        Duration::from_secs(20),
        "calls on every channel",
        futures_util::future::join_all(all),
    )
    .await;
    let after = threads();
    assert!(
        after <= before + 2,
        "{mode:?}: {CHANNELS} channels added {} threads ({before} -> {after})",
        after.saturating_sub(before)
    );
    drop(more);
    echo_seq(&first, 1000).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_polled_channels_share_one_device_and_add_no_threads() {
    channels_add_no_threads(ClientPoller::Caller).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thread_polled_channels_share_the_process_poller_thread() {
    channels_add_no_threads(ClientPoller::Thread).await;
}

/// The channels of a process share one protection domain and one bulk pool per device: a
/// registered buffer one channel gave back is what the next channel's `alloc_bytes` of that
/// size gets (no new registration), and a request lent from it reaches the server through the
/// other channel's connection. Runs on every provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_share_one_bulk_pool() {
    const N: usize = 1 << 20;
    let srv = TestServer::start().await;
    let a = srv.channel(ClientPoller::Caller).await;
    let b = srv.channel(ClientPoller::Caller).await;
    let first = a.alloc_bytes(N).await.unwrap();
    let at = first.as_ptr();
    drop(first);
    let mut again = b.alloc_bytes(N).await.unwrap();
    assert_eq!(
        again.as_ptr(),
        at,
        "channel b registered a buffer of its own: the pool is not shared"
    );
    assert!(
        again.iter().all(|&x| x == 0),
        "a reused buffer kept old bytes"
    );
    again.copy_from_slice(&common::pattern(N, 9));
    // Lent from the shared PD through a window for b's connection, READ by the server.
    let region = again.freeze();
    let mut req = rpc_core::Request::new(common::Blob {
        seq: 9,
        data: region.bytes(),
    });
    req.set_registered(&region);
    let zc = b.zero_copy_request_bytes();
    let r = within(
        Duration::from_secs(60),
        "echo",
        b.unary::<_, common::Blob>(&common::lab_server::ECHO, req),
    )
    .await
    .unwrap();
    common::check_blob(r.get_ref(), 9, N, "echo lent from the shared pool");
    assert_eq!(
        b.zero_copy_request_bytes() - zc,
        N as u64,
        "not sent in place"
    );
    echo_seq(&a, 1).await;
}

/// Opens `n` caller-polled channels of `geometry` to `srv` one after another, each answering
/// a call.
async fn open_with(
    srv: &TestServer,
    n: u64,
    geometry: rpc_core::Geometry,
) -> Vec<rpc_core::Channel> {
    let mut chans = Vec::new();
    for i in 0..n {
        let connect = srv
            .builder()
            .poller(ClientPoller::Caller)
            .geometry(geometry)
            .connect();
        let ch = within(Duration::from_secs(20), "connect", connect)
            .await
            .unwrap_or_else(|e| panic!("connection {i} refused: {e}"));
        echo_seq(&ch, i).await;
        chans.push(ch);
    }
    chans
}

/// `n` calls at once on `ch` that each take 20 ms in the handler: all in flight together.
async fn slow_calls_at_once(ch: &rpc_core::Channel, n: u64) {
    let calls = (0..n).map(|seq| {
        let req = rpc_core::Request::new(common::SleepRequest {
            seq,
            ms: 20,
            reply_len: 16,
            pad: bytes::Bytes::new(),
        });
        ch.unary::<_, common::Blob>(&common::lab_server::SLEEP, req)
    });
    let all = futures_util::future::join_all(calls);
    for (seq, r) in within(Duration::from_secs(60), "slow calls", all)
        .await
        .into_iter()
        .enumerate()
    {
        let r = r.unwrap_or_else(|st| panic!("slow call {seq} failed: {st:?}"));
        assert_eq!(
            r.get_ref().seq,
            seq as u64,
            "slow call {seq}: answered another call"
        );
    }
}

/// Four calls at once on every channel of `chans`, all in flight together.
async fn four_calls_at_once_on_each(chans: &[rpc_core::Channel]) {
    let all = chans
        .iter()
        .enumerate()
        .flat_map(|(i, ch)| (0..4).map(move |k| echo_seq(ch, 100_000 + 4 * i as u64 + k)));
    within(
        Duration::from_secs(60),
        "4 calls at once on every channel",
        futures_util::future::join_all(all),
    )
    .await;
}

/// Opens `n` caller-polled channels to `srv` one after another, each answering a call; then
/// every one answers again, and all of them at once, several calls each.
async fn open_and_serve(srv: &TestServer, n: usize) -> Vec<rpc_core::Channel> {
    let mut chans = Vec::with_capacity(n);
    for i in 0..n {
        let connect = srv.builder().poller(ClientPoller::Caller).connect();
        let ch = within(Duration::from_secs(20), "connect", connect)
            .await
            .unwrap_or_else(|e| panic!("connection {i} refused: {e}"));
        if i % 50 == 0 {
            echo_seq(&ch, i as u64).await;
        }
        chans.push(ch);
    }
    for (i, ch) in chans.iter().enumerate() {
        echo_seq(ch, 10_000 + i as u64).await;
    }
    four_calls_at_once_on_each(&chans).await;
    chans
}

/// The channels of a process take their send slots from one pool, registered as their calls
/// need them, and each registers a small receive window that grows with its calls in flight:
/// not 128 + 128 slots (2 MiB) registered per channel. A hundred channels with four calls
/// each in flight register a few chunks of send slots and windows of 8 to 32 slots, each channel
/// stays within its cap, and every send slot comes back. A channel with many calls in flight
/// grows its window, gives it back after a quiet spell, and grows it again. Runs on every
/// provider.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_share_send_slots_and_grow_small_receive_windows() {
    let _many = MANY.lock().await;
    // A slot size no other test of this process uses: a pool of these channels' own (the
    // process keeps one per slot size), which the other tests' calls do not grow meanwhile.
    const SLOT: u32 = 8128;
    let srv = TestServer::start().await;
    let geometry = rpc_core::Geometry {
        slot_size: SLOT,
        ..rpc_core::Geometry::default()
    };
    let chans = open_with(&srv, 100, geometry).await;
    four_calls_at_once_on_each(&chans).await;
    let s = chans[0].slots();
    assert_eq!(
        (s.send_cap, s.recv_max, s.slot_size),
        (128, 128, SLOT),
        "{s:?}"
    );
    // Four calls at once on each of 100 channels: at most 400 requests staged at a time.
    assert!(
        s.registered >= 32 && s.registered <= 448,
        "100 channels registered {} send slots (one arena each: 12,800)",
        s.registered
    );
    for (i, ch) in chans.iter().enumerate() {
        let t = ch.slots();
        assert_eq!(
            t.registered, s.registered,
            "channel {i} has a pool of its own: {t:?}"
        );
        assert!(t.send_held <= t.send_cap, "channel {i}: {t:?}");
        assert!(
            (8..=32).contains(&t.recv_window),
            "channel {i}: four calls at once need no more than 32 receive slots: {t:?}"
        );
    }
    // Idle again, and calls made once more: the slots came back (the pool did not grow).
    for (i, ch) in chans.iter().enumerate() {
        echo_seq(ch, 500_000 + i as u64).await;
    }
    let after = chans[99].slots();
    assert_eq!(after.registered, s.registered, "{after:?}");
    assert!(
        after.free + 100 >= after.registered,
        "slots still held after every call ended: {after:?}"
    );
    // Many calls at once on one channel: its window grows to hold them.
    let ch = &chans[0];
    slow_calls_at_once(ch, 48).await;
    let grown = ch.slots();
    assert!(
        grown.recv_window >= 32 && grown.recv_window <= grown.recv_max,
        "48 calls at once: {grown:?}"
    );
    // Calls one at a time: after a quiet spell (a second, at least) the window gives its
    // regions back, down to the 8 slots it started with.
    let start = std::time::Instant::now();
    let mut seq = 900_000;
    while ch.slots().recv_window > 8 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "one call at a time for 120 s, and the window is still {:?}",
            ch.slots()
        );
        echo_seq(ch, seq).await;
        seq += 1;
    }
    assert!(
        start.elapsed() >= Duration::from_secs(1),
        "shrank after {:?}",
        start.elapsed()
    );
    // And grows again for the next burst.
    slow_calls_at_once(ch, 48).await;
    assert!(ch.slots().recv_window >= 32, "{:?}", ch.slots());
}

/// A ring too small for the reserve of control credits, or a window of 4 to 7 slots (the first
/// window is a power of two): the first is refused before anything is made, with the reason;
/// the second works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receive_rings_below_four_slots_are_refused_with_the_reason() {
    let srv = TestServer::start().await;
    let small = |recv_slots| rpc_core::Geometry {
        recv_slots,
        ..rpc_core::Geometry::default()
    };
    let connect = srv.builder().geometry(small(3)).connect();
    let e = within(Duration::from_secs(20), "connect", connect)
        .await
        .expect_err("a ring of 3 receive slots");
    assert!(e.to_string().contains("4 to 16,384 receive slots"), "{e}");
    let chans = open_with(&srv, 1, small(6)).await;
    let s = chans[0].slots();
    assert_eq!((s.recv_window, s.recv_max), (4, 6), "{s:?}");
    // Calls that fill the window grow it to the ring, not past it.
    slow_calls_at_once(&chans[0], 12).await;
    assert_eq!(chans[0].slots().recv_window, 6);
}

/// A server with default settings holds hundreds of connections on one shard, past the old
/// walls (64 connections by default; 140 when raised, where the CQ sized for the sum of its
/// QPs' worst cases ran out; about 90 on Soft-RoCE, whose CQs hold 32,767 entries): its CQ
/// grows as they come, up to the device's `max_cqe`, and then the shard adds CQs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_default_server_holds_hundreds_of_connections_on_one_shard() {
    let _many = MANY.lock().await;
    let srv = TestServer::start_with(|b| b.shards(1)).await;
    let chans = open_and_serve(&srv, 300).await;
    assert_eq!(srv.server.connections(), 300);
    drop(chans);
}

/// A shard whose CQ may not grow past 4096 entries (a few connections' send queues beside the
/// receive pool) puts further connections' send completions on CQs it adds, and serves every
/// connection on every one of them, one call at a time and many at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_at_its_cq_limit_adds_cqs_and_serves_every_connection() {
    let _many = MANY.lock().await;
    let srv = TestServer::start_with(|b| b.shards(1).max_cq_entries(4096)).await;
    let chans = open_and_serve(&srv, 120).await;
    // Connections that close give their QPs' room back; new ones are served.
    drop(chans);
    let again = open_and_serve(&srv, 40).await;
    drop(again);
}

/// A client with a large receive ring asks the server for a deep send queue (its share of
/// responses in flight). On a shard whose first CQ is nearly all receive pool, the first
/// connection's send queue does not fit beside the pool's receives: its sends go to a CQ of
/// their own, and it and the connections after it are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_send_queue_that_does_not_fit_beside_the_pool_gets_a_cq_of_its_own() {
    let srv = TestServer::start_with(|b| b.shards(1).max_cq_entries(4096)).await;
    let deep = rpc_core::Geometry {
        recv_slots: 1024,
        ..rpc_core::Geometry::default()
    };
    let chans = open_with(&srv, 6, deep).await;
    for (i, ch) in chans.iter().enumerate() {
        echo_seq(ch, 100 + i as u64).await;
    }
}
