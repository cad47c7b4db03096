//! Streaming semantics beyond gRPC's interop cases (issue 7): per-stream flow control (a slow
//! consumer slows its producer, in-flight messages stay bounded, a stalled stream blocks no
//! other call), large messages inside streams (the bulk path), half-close, empty streams, a
//! status in mid-stream, deadlines and early answers while the client's stream is idle, and
//! the connection's poller modes. Against the provider `RPC_PROVIDER` names (soft when unset).
//!
//! With `RPC_TEST_REMOTE` the cases that need no server-side counter run against the flow
//! server of another host (two VMs in `softroce/ci.sh`, see `interop_service::remote`); the
//! others keep a server in this process.

mod interop_service;

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_core::Stream;
use interop_service::{HANG, channel_stream, intact, payload, remote, within};
use rpc_core::server::RunningServer;
use rpc_core::{
    Channel, ClientPoller, Code, Metadata, Request, Response, Server, Status, Streaming,
};

/// The window every stream starts with (`wire::Config::stream_window`, 16 messages in the
/// client and the server), and the most a consumer opens it to for small messages
/// (`stream_window_max`): 256 KiB of the largest message taken, within the two. Flow-control
/// bounds below are stated in windows.
const WINDOW: u64 = 16;
const WINDOW_MAX: u64 = 256;

/// The window a consumer of `size`-byte messages opens the stream to.
fn window_for(size: u64) -> u64 {
    ((256 << 10) / size.max(1)).clamp(WINDOW, WINDOW_MAX)
}

// ----- the service ------------------------------------------------------------------------------

/// One stream message: its position and a checked payload.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Item {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(bytes = "bytes", tag = "2")]
    pub data: Bytes,
}

/// What `produce` sends: `count` items whose sizes cycle through `sizes`; ends with ABORTED
/// after `fail_after` items when set.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Produce {
    #[prost(uint64, tag = "1")]
    pub count: u64,
    #[prost(uint64, repeated, tag = "2")]
    pub sizes: Vec<u64>,
    #[prost(uint64, optional, tag = "3")]
    pub fail_after: Option<u64>,
}

/// What a consumer of the client's stream saw.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Summary {
    #[prost(uint64, tag = "1")]
    pub count: u64,
    #[prost(uint64, tag = "2")]
    pub bytes: u64,
}

/// The flow-control test service.
#[rpc_derive::service(package = "interop.flow")]
pub trait Flow {
    /// Unary echo.
    async fn ping(&self, request: Item) -> Result<Item, Status>;
    /// Server streaming.
    type Items: Stream<Item = Result<Item, Status>>;
    async fn produce(&self, request: Produce) -> Result<Self::Items, Status>;
    /// Client streaming: counts the client's items (options in request metadata).
    async fn consume(&self, request: Streaming<Item>) -> Result<Summary, Status>;
    /// Bidi: echoes the client's items (options in request metadata).
    async fn echo(&self, request: Streaming<Item>) -> Result<Self::Items, Status>;
}

/// Counts shared by a test and its server (one process): how far a producer ever got ahead of
/// its consumer.
#[derive(Debug, Default)]
struct Counters {
    produced: AtomicU64,
    consumed: AtomicU64,
    max_ahead: AtomicU64,
}

impl Counters {
    fn produced_one(&self) -> u64 {
        let p = self.produced.fetch_add(1, Ordering::SeqCst) + 1;
        let c = self.consumed.load(Ordering::SeqCst);
        self.max_ahead
            .fetch_max(p.saturating_sub(c), Ordering::SeqCst);
        p
    }

    fn consumed_one(&self) {
        self.consumed.fetch_add(1, Ordering::SeqCst);
    }

    fn produced(&self) -> u64 {
        self.produced.load(Ordering::SeqCst)
    }

    fn consumed(&self) -> u64 {
        self.consumed.load(Ordering::SeqCst)
    }

    fn max_ahead(&self) -> u64 {
        self.max_ahead.load(Ordering::SeqCst)
    }

    async fn until(&self, what: &str, f: impl Fn(&Counters) -> bool) {
        let t0 = Instant::now();
        while !f(self) {
            assert!(
                t0.elapsed() < HANG,
                "timed out waiting for: {what} ({self:?})"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

#[derive(Clone)]
struct FlowSvc {
    counters: Arc<Counters>,
    /// `consume` with `hold` waits for this before reading.
    gate: Arc<tokio::sync::Semaphore>,
}

type Items = Pin<Box<dyn Stream<Item = Result<Item, Status>> + Send>>;

fn item(seq: u64, size: usize) -> Item {
    Item {
        seq,
        data: payload(size).body,
    }
}

/// Checks an item received as the `want`-th of its stream.
fn check(m: &Item, want: u64) -> Result<(), Status> {
    if m.seq != want {
        return Err(Status::data_loss(format!(
            "item {} arrived where {want} was due",
            m.seq
        )));
    }
    if !intact(&m.data) {
        return Err(Status::data_loss(format!(
            "item {} ({} bytes) arrived corrupted",
            m.seq,
            m.data.len()
        )));
    }
    Ok(())
}

fn option(md: &Metadata, key: &str) -> Option<u64> {
    md.get_str(key).and_then(|v| v.parse().ok())
}

fn aborted_with_trailer(after: u64) -> Status {
    let mut st = Status::aborted(format!("failed after {after} items"));
    let _ = st
        .metadata_mut()
        .insert("x-failed-after", after.to_string());
    st
}

impl flow_server::Flow for FlowSvc {
    async fn ping(&self, request: Request<Item>) -> Result<Response<Item>, Status> {
        Ok(Response::new(request.into_inner()))
    }

    type ProduceStream = Items;

    async fn produce(&self, request: Request<Produce>) -> Result<Response<Items>, Status> {
        let p = request.into_inner();
        let sizes = if p.sizes.is_empty() { vec![0] } else { p.sizes };
        let counters = Arc::clone(&self.counters);
        let s = futures_util::stream::unfold(0u64, move |seq| {
            let counters = Arc::clone(&counters);
            let sizes = sizes.clone();
            async move {
                if p.fail_after == Some(seq) {
                    return Some((Err(aborted_with_trailer(seq)), u64::MAX));
                }
                if seq >= p.count {
                    return None;
                }
                counters.produced_one();
                let size = sizes[(seq % sizes.len() as u64) as usize] as usize;
                Some((Ok(item(seq, size)), seq + 1))
            }
        });
        Ok(Response::new(Box::pin(s) as Items))
    }

    async fn consume(
        &self,
        request: Request<Streaming<Item>>,
    ) -> Result<Response<Summary>, Status> {
        let md = request.metadata().clone();
        let mut items = request.into_inner();
        if option(&md, "answer-now").is_some() {
            return Ok(Response::new(Summary::default()));
        }
        if option(&md, "hold").is_some() {
            let permit = self.gate.acquire().await;
            drop(permit);
        }
        if let Some(ms) = option(&md, "stall-ms") {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        let every = option(&md, "sleep-every").unwrap_or(u64::MAX);
        let fail_after = option(&md, "fail-after");
        let mut sum = Summary::default();
        loop {
            if fail_after == Some(sum.count) {
                return Err(aborted_with_trailer(sum.count));
            }
            let Some(m) = items.message().await? else {
                break;
            };
            check(&m, sum.count)?;
            self.counters.consumed_one();
            sum.count += 1;
            sum.bytes += m.data.len() as u64;
            if sum.count.is_multiple_of(every) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        Ok(Response::new(sum))
    }

    type EchoStream = Items;

    async fn echo(&self, request: Request<Streaming<Item>>) -> Result<Response<Items>, Status> {
        let md = request.metadata().clone();
        let items = request.into_inner();
        struct St {
            items: Option<Streaming<Item>>,
            seen: u64,
            tail: u64,
            fail_after: Option<u64>,
            drain: bool,
            counters: Arc<Counters>,
        }
        let st = St {
            items: Some(items),
            seen: 0,
            tail: option(&md, "tail").unwrap_or(0),
            fail_after: option(&md, "fail-after"),
            drain: option(&md, "drain").is_some(),
            counters: Arc::clone(&self.counters),
        };
        let s = futures_util::stream::unfold(st, |mut st| async move {
            loop {
                if st.fail_after == Some(st.seen) {
                    st.fail_after = None;
                    st.items = None;
                    st.tail = 0;
                    return Some((Err(aborted_with_trailer(st.seen)), st));
                }
                let Some(items) = st.items.as_mut() else {
                    // The client half-closed: the tail goes out after its end.
                    if st.tail == 0 {
                        return None;
                    }
                    st.tail -= 1;
                    st.seen += 1;
                    return Some((Ok(item(st.seen - 1, 100)), st));
                };
                match items.message().await {
                    Ok(Some(m)) => {
                        if let Err(e) = check(&m, st.seen) {
                            st.items = None;
                            st.tail = 0;
                            return Some((Err(e), st));
                        }
                        st.counters.consumed_one();
                        st.seen += 1;
                        if !st.drain {
                            return Some((Ok(m), st));
                        }
                    }
                    Ok(None) => st.items = None,
                    Err(e) => {
                        st.items = None;
                        st.tail = 0;
                        return Some((Err(e), st));
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(s) as Items))
    }
}

// ----- harness ----------------------------------------------------------------------------------

/// The flow server's slot across two hosts: one server, on the base port.
const FLOW_SLOT: remote::Slot = remote::Slot {
    offset: 0,
    config: |b| b,
};

/// The server side of a two-host run, until stdin closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the server side of a two-host run (softroce/vm.sh pair sets RPC_TEST_SERVE)"]
async fn serve_for_the_pair() {
    remote::serve(
        &[FLOW_SLOT],
        |addr, _| async move { Env::bind(&addr).await.0 },
    )
    .await;
}

struct Env {
    /// The server, when it runs in this process (`None` across two hosts).
    server: Option<RunningServer>,
    addr: String,
    channel: Channel,
    client: flow_client::FlowClient,
    counters: Arc<Counters>,
    gate: Arc<tokio::sync::Semaphore>,
}

impl Env {
    /// Starts a server-streaming `produce` call of `count` messages cycling through `sizes`,
    /// failing with ABORTED after `fail_after` messages when given.
    async fn produce(
        &self,
        count: u64,
        sizes: Vec<u64>,
        fail_after: Option<u64>,
    ) -> Streaming<Item> {
        within(
            "produce",
            self.client.produce(Produce {
                count,
                sizes,
                fail_after,
            }),
        )
        .await
        .expect("produce")
        .into_inner()
    }

    /// Connects to the remote flow server when `RPC_TEST_REMOTE` is set, else starts one here.
    /// Its counters and gate are then this process's, which no handler touches: only the
    /// cases that use neither start this way.
    async fn start() -> Env {
        let Some(addr) = remote::remote_addr(&FLOW_SLOT) else {
            return Env::start_local().await;
        };
        remote::wait_listening(&addr).await;
        let channel = within("connect", Channel::connect(addr.clone()))
            .await
            .expect("connect to the remote flow server");
        Env {
            client: flow_client::FlowClient::new(channel.clone()),
            channel,
            server: None,
            addr,
            counters: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }

    /// A flow server here, with its counters and gate.
    async fn bind(addr: &str) -> (RunningServer, Arc<Counters>, Arc<tokio::sync::Semaphore>) {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| "warn".into()),
            )
            .with_test_writer()
            .try_init();
        let svc = FlowSvc {
            counters: Arc::default(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
        };
        let (counters, gate) = (Arc::clone(&svc.counters), Arc::clone(&svc.gate));
        let server = Server::builder()
            .add_service(flow_server::FlowServer::new(svc))
            .bind(addr)
            .await
            .expect("bind the flow server");
        (server, counters, gate)
    }

    /// Starts a flow server here (also across two hosts) and connects to it.
    async fn start_local() -> Env {
        let (server, counters, gate) = Env::bind("127.0.0.1:0").await;
        let addr = server.local_addr().to_string();
        let channel = within("connect", Channel::connect(addr.clone()))
            .await
            .expect("connect");
        Env {
            client: flow_client::FlowClient::new(channel.clone()),
            channel,
            server: Some(server),
            addr,
            counters,
            gate,
        }
    }

    async fn finish(self) {
        // (A remote server checks its live calls when it ends.)
        if let Some(server) = &self.server {
            let t0 = Instant::now();
            while server.live_calls() != 0 {
                assert!(
                    t0.elapsed() < HANG,
                    "the server still holds {} calls",
                    server.live_calls()
                );
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        drop(self.client);
        drop(self.channel);
        if let Some(server) = self.server {
            within("shutdown", server.shutdown()).await;
        }
    }
}

fn with_md<T>(message: T, entries: &[(&str, &str)]) -> Request<T> {
    let mut r = Request::new(message);
    for (k, v) in entries {
        r.metadata_mut()
            .insert(*k, *v)
            .expect("valid test metadata");
    }
    r
}

/// A lazy client stream of `count` items whose sizes cycle through `sizes`; counts each item
/// as produced when the runtime pulls it.
fn counted_items(
    counters: &Arc<Counters>,
    count: u64,
    sizes: &'static [usize],
) -> impl Stream<Item = Item> + Send + 'static {
    let counters = Arc::clone(counters);
    futures_util::stream::iter(0..count).map(move |seq| {
        counters.produced_one();
        item(seq, sizes[(seq % sizes.len() as u64) as usize])
    })
}

use futures_util::StreamExt;

/// Reads a whole stream, checking order and content; calls `each` after every item.
async fn drain(s: &mut Streaming<Item>, mut each: impl AsyncFnMut(u64)) -> Result<u64, Status> {
    let mut n = 0;
    while let Some(m) = within("next item", s.message()).await? {
        check(&m, n).unwrap_or_else(|e| panic!("{e}"));
        n += 1;
        each(n).await;
    }
    Ok(n)
}

// ----- flow control -----------------------------------------------------------------------------

/// A slow consumer slows the producer: the server's stream is pulled only as the window allows,
/// so the producer is never more than one window ahead of what the client consumed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_consumer_slows_the_producer() {
    let env = Env::start_local().await; // reads the server's counters
    // Small messages (the window opens to its maximum), then large ones (the bulk path, the
    // window stays at its start).
    for (count, size) in [(600u64, 100u64), (60, 64 << 10)] {
        let svc_counters = Arc::clone(&env.counters);
        let mut s = env.produce(count, vec![size], None).await;
        // Before anything is consumed the producer runs a whole window ahead (pipelining)...
        env.counters
            .until("the producer filled the window", |c| c.produced() >= WINDOW)
            .await;
        // ...and no further while the consumer takes one message every millisecond.
        let n = drain(&mut s, async |_| {
            svc_counters.consumed_one();
            tokio::time::sleep(Duration::from_millis(1)).await;
        })
        .await
        .expect("the stream ends OK");
        assert_eq!(n, count);
        // The window is given back inside `message()`, before the drain callback counts the
        // message consumed: the producer may be one ahead of what the counter shows.
        let ahead = env.counters.max_ahead();
        let window = window_for(size);
        assert!(
            ahead <= window + 1,
            "the producer got {ahead} messages ahead of the consumer (window {window}, bound {})",
            window + 1
        );
        if window > WINDOW {
            assert!(
                ahead > WINDOW + 1,
                "the window never opened past {WINDOW}: {ahead}"
            );
        }
        // Reset for the next size.
        env.counters.produced.store(0, Ordering::SeqCst);
        env.counters.consumed.store(0, Ordering::SeqCst);
        env.counters.max_ahead.store(0, Ordering::SeqCst);
    }
    env.finish().await;
}

/// A stream whose messages grow from small to large mid-way: the window the consumer opened
/// for the small ones (256) lets large ones through by the bulk path, each lent and released in
/// order (at most 16 loans open at the sender), and everything arrives intact and in order.
/// A consumer that pauses after the small ones still bounds the producer by that window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_growing_from_small_to_large_messages() {
    let env = Env::start_local().await; // reads the server's counters
    let mut sizes = vec![100u64; 300];
    sizes.extend([96 << 10; 100]);
    let count = sizes.len() as u64;
    let c = Arc::clone(&env.counters);
    let mut s = env.produce(count, sizes, None).await;
    let n = drain(&mut s, async |i| {
        c.consumed_one();
        if i == 300 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .expect("the stream ends OK");
    assert_eq!(n, count);
    let ahead = env.counters.max_ahead();
    assert!(
        ahead <= window_for(100) + 1,
        "the producer got {ahead} messages ahead (window {})",
        window_for(100)
    );
    env.finish().await;
}

/// A fast producer of 10,000 messages against a consumer that sleeps: what is in flight stays
/// within the window in both directions, whatever the producer could make.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_producer_stays_bounded() {
    let env = Env::start_local().await; // reads the server's counters
    const N: u64 = 10_000;

    // Server -> client: the consumer starts 200 ms late, then sleeps every 1,000 messages.
    let mut s = env.produce(N, vec![64], None).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stalled_at = env.counters.produced();
    assert!(
        stalled_at <= WINDOW,
        "with nobody reading, the producer made {stalled_at} messages (window {WINDOW})"
    );
    let c = Arc::clone(&env.counters);
    let n = drain(&mut s, async |i| {
        c.consumed_one();
        if i.is_multiple_of(1000) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the stream ends OK");
    assert_eq!(n, N);
    // The window is given back inside `message()`, before the drain callback counts the
    // message consumed: the producer may be one ahead of what the counter shows.
    assert!(
        env.counters.max_ahead() <= window_for(64) + 1,
        "{:?}",
        env.counters
    );

    // Client -> server: the handler starts 200 ms late and sleeps every 1,000 messages. The
    // client pulls at most one window ahead, plus the item it holds while the window is shut.
    let svc = Arc::clone(&env.counters);
    svc.produced.store(0, Ordering::SeqCst);
    svc.consumed.store(0, Ordering::SeqCst);
    svc.max_ahead.store(0, Ordering::SeqCst);
    let req = with_md(
        counted_items(&svc, N, &[64]),
        &[("stall-ms", "200"), ("sleep-every", "1000")],
    );
    let sum = within("consume", env.client.consume(req))
        .await
        .expect("consume")
        .into_inner();
    assert_eq!(
        sum,
        Summary {
            count: N,
            bytes: 64 * N
        }
    );
    let ahead = svc.max_ahead();
    assert!(
        ahead <= window_for(64) + 1,
        "the client pulled {ahead} messages ahead of the handler (bound {})",
        window_for(64) + 1
    );
    env.finish().await;
}

/// A stalled stream (nobody reads it) blocks no other call on the same connection: unary calls,
/// other streams in both directions complete meanwhile. Then the stalled streams resume.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stream_blocks_no_other_call() {
    let env = Env::start_local().await; // reads the server's counters
    // A server stream nobody reads: its producer stops at one window.
    let mut stalled = env.produce(1000, vec![200], None).await;
    env.counters
        .until("the producer filled the window", |c| c.produced() >= WINDOW)
        .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        env.counters.produced(),
        WINDOW,
        "nobody reads: one window, no more"
    );
    // A client stream the server does not read (the handler waits at the gate).
    let held_counters = Arc::new(Counters::default());
    let held = tokio::spawn({
        let client = env.client.clone();
        let req = with_md(counted_items(&held_counters, 500, &[300]), &[("hold", "1")]);
        async move { client.consume(req).await }
    });
    held_counters
        .until("the client stream stalls", |c| c.produced() > WINDOW)
        .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    let held_at = held_counters.produced();
    assert!(
        held_at <= WINDOW + 1,
        "the unread client stream went {held_at} messages ahead"
    );

    // Meanwhile on the same connection:
    for i in 0..200u64 {
        let r = within("ping", env.client.ping(item(i, 100)))
            .await
            .expect("unary call while streams are stalled");
        assert_eq!(r.into_inner().seq, i);
    }
    let other = Channel::clone(&env.channel);
    let mut s = within(
        "second produce",
        flow_client::FlowClient::new(other).produce(Produce {
            count: 300,
            sizes: vec![50, 20_000],
            fail_after: None,
        }),
    )
    .await
    .expect("produce")
    .into_inner();
    assert_eq!(drain(&mut s, async |_| {}).await.expect("OK"), 300);
    let c = Arc::new(Counters::default());
    let sum = within(
        "second consume",
        env.client.consume(counted_items(&c, 300, &[10, 9000])),
    )
    .await
    .expect("consume")
    .into_inner();
    assert_eq!(sum.count, 300);
    assert_eq!(
        env.counters.produced(),
        300 + WINDOW,
        "the stalled producer moved"
    );
    assert_eq!(
        held_counters.produced(),
        held_at,
        "the held client stream moved"
    );

    // Release both: they run to the end.
    let n = drain(&mut stalled, async |_| {}).await.expect("OK");
    assert_eq!(n, 1000);
    env.gate.add_permits(1);
    let sum = within("held consume", held)
        .await
        .expect("task")
        .expect("consume")
        .into_inner();
    assert_eq!(sum.count, 500);
    env.finish().await;
}

/// Messages above the eager threshold (the 8 KiB slot) inside streams take the bulk path (an
/// RDMA READ of the sender's buffer) and arrive intact and in order, interleaved with small
/// ones, in each direction and both at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_in_streams_take_the_bulk_path() {
    static SIZES: [usize; 8] = [9000, 10, 100_000, 8192, 1 << 20, 0, 3 << 20, 7000];
    let total: u64 = SIZES.iter().map(|&s| s as u64).sum::<u64>() * 2;
    let env = Env::start().await;

    let mut s = env
        .produce(
            2 * SIZES.len() as u64,
            SIZES.iter().map(|&s| s as u64).collect(),
            None,
        )
        .await;
    let mut bytes = 0u64;
    let mut seq = 0u64;
    while let Some(m) = within("item", s.message()).await.expect("OK") {
        check(&m, seq).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(m.data.len(), SIZES[seq as usize % SIZES.len()]);
        bytes += m.data.len() as u64;
        seq += 1;
    }
    assert_eq!(bytes, total);

    let c = Arc::new(Counters::default());
    let sum = within(
        "consume",
        env.client
            .consume(counted_items(&c, 2 * SIZES.len() as u64, &SIZES)),
    )
    .await
    .expect("consume")
    .into_inner();
    assert_eq!(sum.bytes, total);

    let c = Arc::new(Counters::default());
    let mut s = within(
        "echo",
        env.client
            .echo(counted_items(&c, 2 * SIZES.len() as u64, &SIZES)),
    )
    .await
    .expect("echo")
    .into_inner();
    let mut seq = 0u64;
    while let Some(m) = within("echoed item", s.message()).await.expect("OK") {
        check(&m, seq).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(m.data.len(), SIZES[seq as usize % SIZES.len()]);
        seq += 1;
    }
    assert_eq!(seq, 2 * SIZES.len() as u64);
    env.finish().await;
}

// ----- stream life cycle ------------------------------------------------------------------------

/// Half-close: the client finishes sending and keeps receiving; what the server sends after it
/// saw the client's end still arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_then_keep_receiving() {
    let env = Env::start().await;
    let (tx, items) = channel_stream::<Item>(8);
    let mut s = within("echo", env.client.echo(with_md(items, &[("tail", "3")])))
        .await
        .expect("echo")
        .into_inner();
    for i in 0..5 {
        tx.send(item(i, 500)).await.expect("send");
    }
    drop(tx); // half-close
    let n = drain(&mut s, async |_| {}).await.expect("OK");
    assert_eq!(
        n,
        5 + 3,
        "5 echoes, then 3 messages sent after the half-close"
    );
    env.finish().await;
}

/// Empty streams each way: no request, no response, or neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn empty_streams_both_ways() {
    let env = Env::start_local().await; // reads the server's counters
    // Server streaming with nothing to send.
    let mut s = within("produce 0", env.client.produce(Produce::default()))
        .await
        .expect("produce")
        .into_inner();
    assert!(within("end", s.message()).await.expect("OK").is_none());
    // Client streaming with nothing to send.
    let sum = within(
        "consume nothing",
        env.client.consume(futures_util::stream::empty::<Item>()),
    )
    .await
    .expect("consume")
    .into_inner();
    assert_eq!(sum, Summary::default());
    // Bidi, empty both ways.
    let mut s = within(
        "echo nothing",
        env.client.echo(futures_util::stream::empty::<Item>()),
    )
    .await
    .expect("echo")
    .into_inner();
    assert!(within("end", s.message()).await.expect("OK").is_none());
    // Bidi, the client sends nothing, the server sends.
    let req = with_md(futures_util::stream::empty::<Item>(), &[("tail", "4")]);
    let mut s = within("echo tail", env.client.echo(req))
        .await
        .expect("echo")
        .into_inner();
    assert_eq!(drain(&mut s, async |_| {}).await.expect("OK"), 4);
    // Bidi, the client sends, the server sends nothing.
    let c = Arc::new(Counters::default());
    let req = with_md(counted_items(&c, 40, &[64]), &[("drain", "1")]);
    let mut s = within("echo drain", env.client.echo(req))
        .await
        .expect("echo")
        .into_inner();
    assert!(within("end", s.message()).await.expect("OK").is_none());
    assert_eq!(env.counters.consumed(), 40);
    env.finish().await;
}

/// A status in mid-stream: the messages before it arrive, then the status (with its trailers),
/// then the end. In client streams the client stops sending once the server failed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_status_in_mid_stream() {
    let env = Env::start().await;
    let want = |e: &Status, after: u64| {
        assert_eq!(e.code(), Code::Aborted, "{e}");
        assert_eq!(
            e.metadata().get_str("x-failed-after"),
            Some(after.to_string().as_str())
        );
    };
    // Server streaming.
    let mut s = env.produce(100, vec![10, 20_000], Some(3)).await;
    let e = drain(&mut s, async |_| {}).await.expect_err("ABORTED");
    want(&e, 3);
    assert!(within("after", s.message()).await.expect("ended").is_none());

    // Client streaming: the server fails after 3 of 10,000; the call ends at once and the
    // client stops pulling its stream.
    let c = Arc::new(Counters::default());
    let req = with_md(counted_items(&c, 10_000, &[64]), &[("fail-after", "3")]);
    let e = within("consume", env.client.consume(req))
        .await
        .expect_err("ABORTED");
    want(&e, 3);
    let pulled = c.produced();
    assert!(
        pulled <= 3 + WINDOW + 1,
        "the client pulled {pulled} items of a call that had failed"
    );

    // Bidi while the client is still sending: echoes, then the status; the request stream is
    // dropped.
    let (tx, items) = channel_stream::<Item>(64);
    for i in 0..10 {
        tx.send(item(i, 100)).await.expect("send");
    }
    let mut s = within(
        "echo",
        env.client.echo(with_md(items, &[("fail-after", "5")])),
    )
    .await
    .expect("echo")
    .into_inner();
    let e = drain(&mut s, async |_| {}).await.expect_err("ABORTED");
    want(&e, 5);
    within("the request stream is dropped", tx.closed()).await;
    env.finish().await;
}

/// Deadlines cover the whole call: a client stream that has nothing to send does not keep a
/// client-streaming call past its deadline, and the request stream is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadline_while_the_client_stream_is_idle() {
    let env = Env::start().await;
    let (tx, items) = channel_stream::<Item>(4);
    tx.send(item(0, 10)).await.expect("send");
    let mut req = Request::new(items);
    req.set_timeout(Duration::from_millis(200));
    let t0 = Instant::now();
    let e = within("consume", env.client.consume(req))
        .await
        .expect_err("DEADLINE_EXCEEDED");
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    within("the request stream is dropped", tx.closed()).await;
    env.finish().await;
}

/// A server that answers a client-streaming call without reading it ends the call at once,
/// even while the client's stream is idle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_early_answer_ends_an_idle_client_stream() {
    let env = Env::start().await;
    let (tx, items) = channel_stream::<Item>(4);
    let sum = within(
        "consume",
        env.client.consume(with_md(items, &[("answer-now", "1")])),
    )
    .await
    .expect("the early answer")
    .into_inner();
    assert_eq!(sum, Summary::default());
    within("the request stream is dropped", tx.closed()).await;
    env.finish().await;
}

/// Dropping a server stream mid-way cancels the call: the producer stops within the window the
/// consumer had granted, and makes nothing more.
///
/// The bound is the opened window, not the first one: the consumer's grant after its first
/// quarter window (4 messages of 100 B) opens the window to `window_for(100)`, so a producer
/// quick enough (or a cancel slow enough, as on Soft-RoCE under emulation) fills all of it
/// before the cancel arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_stream_stops_its_producer() {
    let env = Env::start_local().await; // reads the server's counters
    let mut s = env.produce(100_000, vec![100], None).await;
    for i in 0..5 {
        let m = within("item", s.message())
            .await
            .expect("OK")
            .expect("an item");
        assert_eq!(m.seq, i);
    }
    drop(s);
    // The cancel frees the call, and with it the producer: what it made by then is all it makes.
    let server = env.server.as_ref().expect("a local server");
    let t0 = Instant::now();
    while server.live_calls() != 0 {
        assert!(
            t0.elapsed() < HANG,
            "the dropped stream's call was never freed"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let produced = env.counters.produced();
    let bound = 5 + window_for(100);
    assert!(
        produced <= bound,
        "the producer made {produced} items for a stream dropped after 5 (bound {bound})"
    );
    env.finish().await;
}

/// Many short bidi calls, a few at a time: each one's single message and half-close reach the
/// server however the request races the stream (a lost message hangs the call).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_short_bidi_calls() {
    let env = Env::start().await;
    let mut tasks = Vec::new();
    for t in 0..4u64 {
        let client = env.client.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..100u64 {
                let one = futures_util::stream::iter([item(0, (t * 100 + i) as usize % 300)]);
                let mut s = within("echo", client.echo(one))
                    .await
                    .expect("echo")
                    .into_inner();
                let m = within("echo reply", s.message())
                    .await
                    .expect("OK")
                    .expect("the echo");
                assert_eq!(m.seq, 0);
                assert!(within("end", s.message()).await.expect("OK").is_none());
            }
        }));
    }
    for t in tasks {
        within("task", t).await.expect("no panic");
    }
    env.finish().await;
}

/// The three streaming kinds with the caller-driven poller (no poller thread).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_with_the_caller_poller() {
    let env = Env::start().await;
    let ch = within(
        "connect",
        Channel::builder(env.addr.clone())
            .poller(ClientPoller::Caller)
            .connect(),
    )
    .await
    .expect("connect");
    let client = flow_client::FlowClient::new(ch);
    let mut s = within(
        "produce",
        client.produce(Produce {
            count: 100,
            sizes: vec![100, 10_000],
            fail_after: None,
        }),
    )
    .await
    .expect("produce")
    .into_inner();
    assert_eq!(drain(&mut s, async |_| {}).await.expect("OK"), 100);
    let c = Arc::new(Counters::default());
    let sum = within(
        "consume",
        client.consume(counted_items(&c, 100, &[100, 10_000])),
    )
    .await
    .expect("consume")
    .into_inner();
    assert_eq!(sum.count, 100);
    let mut s = within("echo", client.echo(counted_items(&c, 100, &[100, 10_000])))
        .await
        .expect("echo")
        .into_inner();
    assert_eq!(drain(&mut s, async |_| {}).await.expect("OK"), 100);
    drop(client);
    env.finish().await;
}

/// Many stalled streams at once, each direction, on one connection: their unread messages must
/// not take every receive slot of the connection (each stream may hold a window, and ten
/// windows are more than a ring), so unary calls and other streams still go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_stalled_streams_do_not_starve_the_connection() {
    const STREAMS: u64 = 10;
    let env = Env::start_local().await; // reads the server's counters
    // Server -> client: ten server streams nobody reads.
    let mut stalled = Vec::new();
    for _ in 0..STREAMS {
        let s = env.produce(100, vec![200], None).await;
        stalled.push(s);
    }
    env.counters
        .until("every producer filled its window", |c| {
            c.produced() >= STREAMS * WINDOW
        })
        .await;
    // Client -> server: ten client streams the server does not read.
    let mut held = Vec::new();
    let mut held_counters = Vec::new();
    for _ in 0..STREAMS {
        let c = Arc::new(Counters::default());
        let req = with_md(counted_items(&c, 100, &[200]), &[("hold", "1")]);
        let client = env.client.clone();
        held.push(tokio::spawn(async move { client.consume(req).await }));
        held_counters.push(c);
    }
    for c in &held_counters {
        c.until("the client stream stalls", |c| c.produced() > WINDOW)
            .await;
    }
    // The connection still serves other calls.
    for i in 0..50u64 {
        let r = within("ping", env.client.ping(item(i, 100)))
            .await
            .expect("unary call beside stalled streams");
        assert_eq!(r.into_inner().seq, i);
    }
    let mut s = env.produce(200, vec![300], None).await;
    assert_eq!(drain(&mut s, async |_| {}).await.expect("OK"), 200);
    // Release everything: all of it completes, in order.
    for mut s in stalled {
        assert_eq!(drain(&mut s, async |_| {}).await.expect("OK"), 100);
    }
    env.gate.add_permits(STREAMS as usize);
    for h in held {
        let sum = within("held consume", h)
            .await
            .expect("task")
            .expect("consume")
            .into_inner();
        assert_eq!(sum.count, 100);
    }
    env.finish().await;
}

/// Streams of large messages (each moved by an RDMA READ, later ones held behind it) cancelled
/// or failed while READs are in flight: the connection survives and every call slot and lent
/// buffer comes back (64 wire call slots: a leak per call would hang the later rounds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_and_failed_streams_of_large_messages_leave_the_connection_clean() {
    static BIG: [usize; 2] = [64 << 10, 9000];
    let env = Env::start().await;
    // One round more than a connection's 64 wire call slots.
    for round in 0..68u64 {
        match round % 4 {
            // Server stream dropped after the first message.
            0 => {
                let mut s = env.produce(40, vec![64 << 10, 9000], None).await;
                within("first", s.message())
                    .await
                    .expect("OK")
                    .expect("an item");
            }
            // Server stream failing after a few large messages.
            1 => {
                let mut s = env.produce(40, vec![64 << 10], Some(3)).await;
                let e = drain(&mut s, async |_| {}).await.expect_err("ABORTED");
                assert_eq!(e.code(), Code::Aborted, "{e}");
            }
            // Client stream the server fails after 2 messages.
            2 => {
                let c = Arc::new(Counters::default());
                let req = with_md(counted_items(&c, 40, &BIG), &[("fail-after", "2")]);
                let e = within("consume", env.client.consume(req))
                    .await
                    .expect_err("ABORTED");
                assert_eq!(e.code(), Code::Aborted, "{e}");
            }
            // Client stream cancelled (its future dropped) while it is being sent.
            _ => {
                let c = Arc::new(Counters::default());
                let call = env.client.consume(counted_items(&c, 40, &BIG));
                let r = tokio::time::timeout(Duration::from_millis(3), call).await;
                assert!(r.is_err() || r.is_ok_and(|r| r.is_ok()));
            }
        }
        assert!(env.channel.is_connected(), "round {round}: connection lost");
    }
    let r = within("ping", env.client.ping(item(7, 100)))
        .await
        .expect("the connection still serves calls");
    assert_eq!(r.into_inner().seq, 7);
    assert!(env.channel.is_connected());
    env.finish().await;
}

/// Streams outlive the channel they were started on: dropping every handle of the channel
/// does not strand a stream in flight (as a tonic client's streams keep their connection).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_outlive_their_channel() {
    let env = Env::start().await;
    let ch = within("connect", Channel::connect(env.addr.clone()))
        .await
        .expect("connect");
    let client = flow_client::FlowClient::new(ch);
    let mut s = within(
        "produce",
        client.produce(Produce {
            count: 100,
            sizes: vec![100, 20_000],
            fail_after: None,
        }),
    )
    .await
    .expect("produce")
    .into_inner();
    let (tx, items) = channel_stream::<Item>(4);
    let mut echo = within("echo", client.echo(items))
        .await
        .expect("echo")
        .into_inner();
    drop(client); // the last handle of that channel
    assert_eq!(drain(&mut s, async |_| {}).await.expect("OK"), 100);
    for i in 0..3 {
        tx.send(item(i, 100)).await.expect("send");
        let m = within("echo", echo.message())
            .await
            .expect("OK")
            .expect("the echo");
        assert_eq!(m.seq, i);
    }
    drop(tx);
    assert!(within("end", echo.message()).await.expect("OK").is_none());
    env.finish().await;
}

/// A stream whose call fails before its request leaves (here: a deadline already passed) ends
/// with that status instead of waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_failing_before_its_request_is_sent_ends() {
    let env = Env::start().await;
    let mut req = Request::new(Produce {
        count: 10,
        sizes: vec![10],
        fail_after: None,
    });
    req.set_timeout(Duration::ZERO);
    match within("produce", env.client.produce(req)).await {
        Err(e) => assert_eq!(e.code(), Code::DeadlineExceeded, "{e}"),
        Ok(r) => {
            let mut s = r.into_inner();
            let e = within("the status", s.message())
                .await
                .expect_err("DEADLINE_EXCEEDED");
            assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
        }
    }
    let (_tx, items) = channel_stream::<Item>(1);
    let mut req = Request::new(items);
    req.set_timeout(Duration::ZERO);
    let mut s = within("echo", env.client.echo(req))
        .await
        .expect("the request is queued")
        .into_inner();
    let e = within("the status", s.message())
        .await
        .expect_err("DEADLINE_EXCEEDED");
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    env.finish().await;
}

/// A deadline over a server stream read slowly: the messages received before it arrive, then
/// DEADLINE_EXCEEDED, then the end; the server stops producing and frees the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_ends_a_slow_server_stream() {
    let env = Env::start_local().await; // reads the server's counters
    let mut req = Request::new(Produce {
        count: 100_000,
        sizes: vec![100],
        fail_after: None,
    });
    req.set_timeout(Duration::from_millis(300));
    let t0 = Instant::now();
    let mut s = within("produce", env.client.produce(req))
        .await
        .expect("produce")
        .into_inner();
    let c = Arc::clone(&env.counters);
    let e = drain(&mut s, async |_| {
        c.consumed_one();
        tokio::time::sleep(Duration::from_millis(1)).await;
    })
    .await
    .expect_err("DEADLINE_EXCEEDED");
    assert_eq!(e.code(), Code::DeadlineExceeded, "{e}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    assert!(within("after", s.message()).await.expect("ended").is_none());
    assert!(
        env.counters.consumed() > 0,
        "some messages came before the deadline"
    );
    // The server expires its copy of the deadline and drops the handler...
    let t1 = Instant::now();
    let server = env.server.as_ref().expect("a server in this process");
    while server.live_calls() != 0 {
        assert!(t1.elapsed() < HANG, "the server kept the expired call");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // ...whose stream is not polled again.
    let produced = env.counters.produced();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        env.counters.produced(),
        produced,
        "the producer went on after the deadline"
    );
    env.finish().await;
}
