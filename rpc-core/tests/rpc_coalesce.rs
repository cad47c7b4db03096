//! Coalesced SENDs: the small frames of a turn go in one SEND (a batch of frames in one
//! receive slot). Server streaming of many small messages arrives complete and in order in
//! fewer SENDs than messages (counted by the soft RNIC), and messages that borrow a shared
//! receive slot keep their bytes however long they are kept (the slot goes back to the ring
//! only after every borrow ended).
//!
//! The tests of this binary run one at a time: the soft RNIC's counters are process-wide.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use rpc_core::server::{Dispatched, IncomingCall, RunningServer, Server, Service};
use rpc_core::{CallKind, Channel, MethodDesc, Request, Response, Status, Streaming};

#[derive(Clone, PartialEq, prost::Message)]
struct Msg {
    #[prost(uint64, tag = "1")]
    n: u64,
    #[prost(bytes = "bytes", tag = "2")]
    data: Bytes,
}

static COUNT: MethodDesc = MethodDesc::new("/t.C/Count", CallKind::ServerStreaming);
static ECHO: MethodDesc = MethodDesc::new("/t.C/Echo", CallKind::Streaming);
static METHODS: [MethodDesc; 2] = [COUNT, ECHO];

/// One test at a time (process-wide counters).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const LIMIT: Duration = Duration::from_secs(60);

/// The bytes of message `i` of `size` bytes: differ from message to message and within one.
fn data(i: u64, size: usize) -> Bytes {
    (0..size)
        .map(|k| (i as usize).wrapping_mul(31).wrapping_add(k) as u8)
        .collect::<Vec<u8>>()
        .into()
}

struct Svc;

impl Service for Svc {
    fn name(&self) -> &'static str {
        "t.C"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
        if method == COUNT.id {
            // `n` messages of `data.len()` bytes, all ready at once: the shard sends as many
            // per turn as the stream window allows.
            call.server_streaming(|req: Request<Msg>| async move {
                let m = req.into_inner();
                let size = m.data.len();
                let items = (0..m.n).map(move |i| {
                    Ok(Msg {
                        n: i,
                        data: data(i, size),
                    })
                });
                Ok(Response::new(futures_util::stream::iter(items)))
            })
        } else if method == ECHO.id {
            call.streaming(|req: Request<Streaming<Msg>>| async move {
                let s = req.into_inner();
                Ok(Response::new(s.map(|r: Result<Msg, Status>| r)))
            })
        } else {
            call.unimplemented()
        }
    }
}

async fn serve() -> (RunningServer, Channel) {
    let server = Server::builder()
        .add_service(Svc)
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let ch = Channel::connect(server.local_addr().to_string())
        .await
        .unwrap();
    (server, ch)
}

/// Reads a server stream of `n` messages of `size` bytes, checking order and contents;
/// returns the messages (kept, so borrowed slots stay borrowed).
async fn count(ch: &Channel, n: u64, size: usize) -> Vec<Msg> {
    let resp: Response<Streaming<Msg>> = tokio::time::timeout(
        LIMIT,
        ch.server_streaming(
            &COUNT,
            Request::new(Msg {
                n,
                data: Bytes::from(vec![0; size]),
            }),
        ),
    )
    .await
    .expect("the call started in time")
    .unwrap();
    let mut s = resp.into_inner();
    let mut got = Vec::with_capacity(n as usize);
    while let Some(m) = tokio::time::timeout(LIMIT, s.message())
        .await
        .expect("the next message in time")
        .unwrap()
    {
        assert_eq!(m.n, got.len() as u64, "messages in order");
        assert_eq!(m.data, data(m.n, size), "message {} intact on arrival", m.n);
        got.push(m);
    }
    assert_eq!(got.len() as u64, n, "every message arrived");
    got
}

/// The soft RNIC counters once they stopped moving (an operation is counted just after the
/// peer's completion is published).
fn settled() -> rpc_core::verbs::soft::CounterSnapshot {
    let mut last = rpc_core::verbs::soft::process_counters();
    let mut still = 0;
    for _ in 0..500 {
        std::thread::sleep(Duration::from_millis(2));
        let now = rpc_core::verbs::soft::process_counters();
        if now.ops == last.ops {
            still += 1;
            if still == 3 {
                return now;
            }
        } else {
            still = 0;
        }
        last = now;
    }
    last
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_stream_messages_share_sends_and_arrive_complete_in_order() {
    let _serial = SERIAL.lock().await;
    let (server, ch) = serve().await;
    count(&ch, 100, 32).await; // warm up: connection, pools
    const N: u64 = 20_000;
    let before = settled();
    let (packed_before, frames_before) = ch.packed_stream_messages();
    let got = count(&ch, N, 32).await;
    let after = settled();
    drop(got);
    let (packed, frames) = ch.packed_stream_messages();
    let (packed, frames) = (packed - packed_before, frames - frames_before);
    println!("{packed} of the {N} messages arrived packed, in {frames} frames");
    // A burst goes as one frame: one header, one hand-off to the stream per burst. Under
    // load a handler may yield fewer per turn, but most messages still share a frame.
    assert!(
        packed * 2 > N && frames * 8 < packed,
        "{packed} of {N} messages packed, in {frames} frames: small stream messages were \
         not packed into frames"
    );
    let ops = after.ops - before.ops;
    println!(
        "{N} messages of 32 B in {ops} work requests (both sides): {:.3} per message",
        ops as f64 / N as f64
    );
    // One SEND per message (and a window update per few) was 1.13 work requests per
    // message; a SEND of frames gathered from one send slot each carried up to BATCH_FRAMES
    // (8) of them: 0.13 or more. Packed into one send slot, a SEND carries as many as fit
    // the peer's receive slot (8 KiB: about 140 of these) and the window lets 256 go: about
    // 0.02. A twentieth is far from both.
    assert!(
        ops * 20 < N,
        "{ops} work requests for {N} stream messages: they were not packed"
    );
    // The connection still serves calls of every size after that.
    for size in [1usize, 600, 5000] {
        count(&ch, 50, size).await;
    }
    drop(ch);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn borrowed_messages_of_a_shared_slot_keep_their_bytes() {
    let _serial = SERIAL.lock().await;
    let (server, ch) = serve().await;
    // 600-byte `bytes` fields borrow their receive slot (512 B and up) while the lending
    // budget allows, and several of them share a slot. Keep every message of several calls:
    // far more than the budget; none may see its bytes overwritten by a later SEND.
    let mut kept = Vec::new();
    for _ in 0..4 {
        kept.push(count(&ch, 3_000, 600).await);
    }
    for msgs in &kept {
        for m in msgs {
            assert_eq!(m.data, data(m.n, 600), "message {} kept intact", m.n);
        }
    }
    // Bidi: a client stream of small messages batched the other way, echoed back.
    let items: Vec<Msg> = (0..5_000u64)
        .map(|i| Msg {
            n: i,
            data: data(i, 40),
        })
        .collect();
    let resp: Response<Streaming<Msg>> = tokio::time::timeout(
        LIMIT,
        ch.streaming(&ECHO, Request::new(futures_util::stream::iter(items))),
    )
    .await
    .unwrap()
    .unwrap();
    let mut s = resp.into_inner();
    let mut n = 0u64;
    while let Some(m) = tokio::time::timeout(LIMIT, s.message())
        .await
        .unwrap()
        .unwrap()
    {
        assert_eq!(m.n, n);
        assert_eq!(m.data, data(n, 40));
        n += 1;
    }
    assert_eq!(n, 5_000);
    drop(kept);
    // With every borrow gone the connection still has its whole ring.
    count(&ch, 2_000, 600).await;
    drop(ch);
    server.shutdown().await;
}
