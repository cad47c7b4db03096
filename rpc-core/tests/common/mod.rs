//! Shared pieces of the runtime's integration tests: the `lab.Lab` test service (written with
//! `#[rpc_derive::service]`), its messages, a server/channel harness, payload patterns that
//! catch misplaced or stale bytes, and bounded waits.
//!
//! Every wait here is bounded: a bug fails a test, it never hangs CI.
#![allow(dead_code)]
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod proc;
pub mod remote;

use std::future::Future;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rpc_core::{
    Channel, ChannelBuilder, ClientPoller, Code, Request, Response, RunningServer, Server,
    ServerBuilder, Status,
};

pub use lab_server::LabServer;

// ----- messages ------------------------------------------------------------------------------

/// A payload with a sequence number.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Blob {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(bytes = "bytes", tag = "2")]
    pub data: Bytes,
}

/// Asks for a response of `len` pattern bytes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GenRequest {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(uint64, tag = "2")]
    pub len: u64,
}

/// What the server saw of a request: its length and whether it held the expected pattern.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Digest {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(uint64, tag = "2")]
    pub len: u64,
    #[prost(bool, tag = "3")]
    pub pattern_ok: bool,
}

/// A handler that waits `ms` before answering `reply_len` pattern bytes; `pad` makes the
/// request itself as large as wanted.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SleepRequest {
    #[prost(uint64, tag = "1")]
    pub seq: u64,
    #[prost(uint64, tag = "2")]
    pub ms: u64,
    #[prost(uint64, tag = "3")]
    pub reply_len: u64,
    #[prost(bytes = "bytes", tag = "4")]
    pub pad: Bytes,
}

/// A handler that fails with this status and trailing metadata entry.
#[derive(Clone, PartialEq, prost::Message)]
pub struct FailRequest {
    #[prost(uint32, tag = "1")]
    pub code: u32,
    #[prost(string, tag = "2")]
    pub message: String,
    #[prost(string, tag = "3")]
    pub trailer_key: String,
    #[prost(bytes = "vec", tag = "4")]
    pub trailer_value: Vec<u8>,
}

/// Scalars only: a message whose encoding and decoding allocate nothing.
#[derive(Clone, Copy, PartialEq, prost::Message)]
pub struct Scalars {
    #[prost(uint64, tag = "1")]
    pub a: u64,
    #[prost(uint32, tag = "2")]
    pub b: u32,
    #[prost(double, tag = "3")]
    pub c: f64,
    #[prost(bool, tag = "4")]
    pub d: bool,
    #[prost(sint64, tag = "5")]
    pub e: i64,
}

// ----- the service ---------------------------------------------------------------------------

/// The test service. The server side implements the tonic-shaped `lab_server::Lab` directly
/// (handlers see request metadata and deadlines and set response metadata).
#[rpc_derive::service(package = "lab")]
pub trait Lab {
    /// Returns the request; records its sequence number.
    async fn echo(&self, request: Blob) -> Result<Blob, Status>;
    /// Returns `len` pattern bytes.
    async fn generate(&self, request: GenRequest) -> Result<Blob, Status>;
    /// Checks the request's pattern and returns a digest.
    async fn sink(&self, request: Blob) -> Result<Digest, Status>;
    /// Waits, then answers (drop-guard counted).
    async fn sleep(&self, request: SleepRequest) -> Result<Blob, Status>;
    /// Fails with the status asked for.
    async fn fail(&self, request: FailRequest) -> Result<Blob, Status>;
    /// Echoes the request and returns its metadata (and the deadline seen) as response
    /// metadata.
    async fn meta(&self, request: Blob) -> Result<Blob, Status>;
    /// Scalars in, scalars out, ready at once.
    async fn ping(&self, request: Scalars) -> Result<Scalars, Status>;
    /// Panics: at once (`ms == 0`) or after waiting `ms`.
    async fn explode(&self, request: SleepRequest) -> Result<Blob, Status>;
}

/// Counters shared by a test and its server's handlers.
#[derive(Debug)]
pub struct LabState {
    /// Per sequence number (below `SEEN`): how many times `echo` ran for it.
    pub seen: Box<[AtomicU32]>,
    /// `sleep` handlers started.
    pub started: AtomicU64,
    /// `sleep` handlers that ran to completion.
    pub finished: AtomicU64,
    /// `sleep` handlers dropped before completion (cancelled, expired, disconnected).
    pub dropped: AtomicU64,
    /// Calls of any handler.
    pub calls: AtomicU64,
}

/// Sequence numbers `echo` records.
pub const SEEN: usize = 1 << 15;

impl LabState {
    pub fn new() -> Arc<LabState> {
        Arc::new(LabState {
            seen: (0..SEEN).map(|_| AtomicU32::new(0)).collect(),
            started: AtomicU64::new(0),
            finished: AtomicU64::new(0),
            dropped: AtomicU64::new(0),
            calls: AtomicU64::new(0),
        })
    }

    /// `sleep` handlers started and not yet finished or dropped.
    pub fn sleeping(&self) -> u64 {
        let s = self.started.load(Ordering::Acquire);
        let f = self.finished.load(Ordering::Acquire);
        let d = self.dropped.load(Ordering::Acquire);
        s.saturating_sub(f + d)
    }
}

/// The handlers.
#[derive(Clone, Debug)]
pub struct LabSvc {
    pub state: Arc<LabState>,
}

/// Counts a `sleep` handler as dropped unless it completed.
struct HandlerGuard {
    state: Arc<LabState>,
    completed: bool,
}

impl Drop for HandlerGuard {
    fn drop(&mut self) {
        let c = if self.completed {
            &self.state.finished
        } else {
            &self.state.dropped
        };
        c.fetch_add(1, Ordering::AcqRel);
    }
}

impl lab_server::Lab for LabSvc {
    async fn echo(&self, request: Request<Blob>) -> Result<Response<Blob>, Status> {
        self.state.calls.fetch_add(1, Ordering::Relaxed);
        let b = request.into_inner();
        if let Some(c) = self.state.seen.get(b.seq as usize) {
            c.fetch_add(1, Ordering::AcqRel);
        }
        Ok(Response::new(b))
    }

    async fn generate(&self, request: Request<GenRequest>) -> Result<Response<Blob>, Status> {
        self.state.calls.fetch_add(1, Ordering::Relaxed);
        let r = request.into_inner();
        Ok(Response::new(Blob {
            seq: r.seq,
            data: pattern(r.len as usize, r.seq),
        }))
    }

    async fn sink(&self, request: Request<Blob>) -> Result<Response<Digest>, Status> {
        self.state.calls.fetch_add(1, Ordering::Relaxed);
        let b = request.into_inner();
        Ok(Response::new(Digest {
            seq: b.seq,
            len: b.data.len() as u64,
            pattern_ok: pattern_matches(&b.data, b.seq),
        }))
    }

    async fn sleep(&self, request: Request<SleepRequest>) -> Result<Response<Blob>, Status> {
        self.state.calls.fetch_add(1, Ordering::Relaxed);
        self.state.started.fetch_add(1, Ordering::AcqRel);
        let mut guard = HandlerGuard {
            state: Arc::clone(&self.state),
            completed: false,
        };
        let r = request.into_inner();
        tokio::time::sleep(Duration::from_millis(r.ms)).await;
        guard.completed = true;
        Ok(Response::new(Blob {
            seq: r.seq,
            data: pattern(r.reply_len as usize, r.seq),
        }))
    }

    async fn fail(&self, request: Request<FailRequest>) -> Result<Response<Blob>, Status> {
        self.state.calls.fetch_add(1, Ordering::Relaxed);
        let r = request.into_inner();
        let mut st = Status::new(Code::from_u8(r.code as u8), r.message);
        if !r.trailer_key.is_empty() {
            st.metadata_mut()
                .insert(r.trailer_key, r.trailer_value)
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
        }
        Err(st)
    }

    async fn meta(&self, request: Request<Blob>) -> Result<Response<Blob>, Status> {
        self.state.calls.fetch_add(1, Ordering::Relaxed);
        let timeout = request.timeout();
        let (md, b, _) = request.into_parts();
        let mut resp = Response::new(b);
        for (k, v) in md.iter() {
            resp.metadata_mut()
                .insert(format!("echo-{k}"), v.to_vec())
                .map_err(|e| Status::invalid_argument(e.to_string()))?;
        }
        if let Some(t) = timeout {
            resp.metadata_mut()
                .insert("seen-timeout-ms", t.as_millis().to_string())
                .map_err(|e| Status::internal(e.to_string()))?;
        }
        Ok(resp)
    }

    async fn explode(&self, request: Request<SleepRequest>) -> Result<Response<Blob>, Status> {
        self.state.calls.fetch_add(1, Ordering::Relaxed);
        let ms = request.get_ref().ms;
        if ms > 0 {
            tokio::time::sleep(Duration::from_millis(ms)).await;
        }
        panic!("handler panicked on purpose (test)");
    }

    async fn ping(&self, request: Request<Scalars>) -> Result<Response<Scalars>, Status> {
        let s = request.into_inner();
        Ok(Response::new(Scalars {
            a: s.a.wrapping_add(1),
            b: s.b ^ 0x5a5a,
            c: s.c * 2.0,
            d: !s.d,
            e: -s.e,
        }))
    }
}

// ----- harness -------------------------------------------------------------------------------

/// The address every test binds (loopback; the Soft-RoCE VM uses it too).
pub const LOCALHOST: &str = "127.0.0.1:0";

/// A server of `LabSvc` and its state.
pub struct TestServer {
    pub server: RunningServer,
    pub state: Arc<LabState>,
}

impl std::fmt::Debug for TestServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestServer")
            .field("addr", &self.server.local_addr())
            .finish()
    }
}

impl TestServer {
    /// Starts a default server on a free loopback port.
    pub async fn start() -> TestServer {
        TestServer::start_with(|b| b).await
    }

    /// Starts a server configured by `f` on a free loopback port.
    pub async fn start_with(f: impl FnOnce(ServerBuilder) -> ServerBuilder) -> TestServer {
        TestServer::bind_with(LOCALHOST, f).await
    }

    /// Starts a server configured by `f` on `addr`.
    pub async fn bind_with(
        addr: &str,
        f: impl FnOnce(ServerBuilder) -> ServerBuilder,
    ) -> TestServer {
        TestServer::try_bind_with(addr, f)
            .await
            .expect("server binds")
    }

    /// Starts a server configured by `f` on `addr`, or says why it could not.
    pub async fn try_bind_with(
        addr: &str,
        f: impl FnOnce(ServerBuilder) -> ServerBuilder,
    ) -> Result<TestServer, rpc_core::Error> {
        init_logs();
        let state = LabState::new();
        let b = Server::builder().add_service(LabServer::new(LabSvc {
            state: Arc::clone(&state),
        }));
        let server = within(Duration::from_secs(20), "bind", f(b).bind(addr)).await?;
        Ok(TestServer { server, state })
    }

    pub fn addr(&self) -> String {
        self.server.local_addr().to_string()
    }

    /// A channel builder for this server.
    pub fn builder(&self) -> ChannelBuilder {
        Channel::builder(self.addr())
    }

    /// A connected channel with `mode`.
    pub async fn channel(&self, mode: ClientPoller) -> Channel {
        within(
            Duration::from_secs(20),
            "connect",
            self.builder().poller(mode).connect(),
        )
        .await
        .expect("channel connects")
    }

    /// Waits until no call is live on the server.
    pub async fn settle(&self, what: &str) {
        let server = &self.server;
        wait_until(Duration::from_secs(20), what, || server.live_calls() == 0).await;
    }
}

// ----- across two hosts (`softroce/vm.sh pair`, see `remote`) ---------------------------------

pub use remote::Slot;

/// Where a test's calls go: a server in this process, or the remote one of the same slot.
pub struct Target {
    local: Option<TestServer>,
    addr: String,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("addr", &self.addr)
            .field("local", &self.local.is_some())
            .finish()
    }
}

impl Target {
    /// The remote server of `slot` when `RPC_TEST_REMOTE` is set, else a local one started
    /// with the slot's configuration.
    pub async fn start(slot: &Slot) -> Target {
        init_logs();
        if let Some(addr) = remote::remote_addr(slot) {
            remote::wait_listening(&addr).await;
            return Target { local: None, addr };
        }
        let srv = TestServer::start_with(slot.config).await;
        Target {
            addr: srv.addr(),
            local: Some(srv),
        }
    }

    /// The server, when it runs in this process.
    pub fn local(&self) -> Option<&TestServer> {
        self.local.as_ref()
    }

    pub fn addr(&self) -> String {
        self.addr.clone()
    }

    /// A channel builder for this server.
    pub fn builder(&self) -> ChannelBuilder {
        Channel::builder(self.addr())
    }

    /// A connected channel with `mode` (a remote server gets 60 s to come up).
    pub async fn channel(&self, mode: ClientPoller) -> Channel {
        remote::connect(self.builder().poller(mode)).await
    }

    /// Waits until no call is live on a local server (a remote one checks at its end).
    pub async fn settle(&self, what: &str) {
        if let Some(s) = &self.local {
            s.settle(what).await;
        }
    }

    /// Shuts a local server down (bounded).
    pub async fn shutdown(self) {
        if let Some(s) = self.local {
            within(Duration::from_secs(20), "shutdown", s.server.shutdown()).await;
        }
    }
}

/// [`serve`] for suites of the `lab.Lab` test service.
pub async fn serve_lab(slots: &[Slot]) {
    remote::serve(slots, |addr, slot| async move {
        TestServer::bind_with(&addr, slot.config).await.server
    })
    .await;
}

/// Logs at `RPC_TEST_LOG` level (warn by default), once per process.
pub fn init_logs() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let level = std::env::var("RPC_TEST_LOG").unwrap_or_else(|_| "warn".into());
        let _ = tracing_subscriber::fmt()
            .with_env_filter(level)
            .with_test_writer()
            .try_init();
    });
}

/// `fut`, or a panic naming `what` when it takes longer than `limit`.
pub async fn within<F: Future>(limit: Duration, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {limit:?} (hang)"),
    }
}

/// Polls `cond` every 5 ms until it holds; panics naming `what` after `limit`.
pub async fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < limit,
            "{what}: condition not reached within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Runs a blocking closure on a blocking thread, bounded by `limit`.
pub async fn blocking<T: Send + 'static>(
    limit: Duration,
    what: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    within(limit, what, tokio::task::spawn_blocking(f))
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

/// One `lab.Lab/Echo` call on `ch` carrying `seq` and 16 bytes of its pattern; panics when it
/// takes over a minute.
pub async fn echo_call(ch: &Channel, seq: u64) -> Result<Response<Blob>, Status> {
    let req = Request::new(Blob {
        seq,
        data: pattern(16, seq),
    });
    within(
        Duration::from_secs(60),
        "echo",
        ch.unary::<_, Blob>(&lab_server::ECHO, req),
    )
    .await
}

/// [`echo_call`] that must succeed: panics when it fails (naming `seq`), hangs, or answers
/// another `seq`.
pub async fn echo_seq(ch: &Channel, seq: u64) {
    let r = echo_call(ch, seq)
        .await
        .unwrap_or_else(|st| panic!("echo {seq} failed: {st:?}"));
    assert_eq!(r.get_ref().seq, seq, "echo {seq}: answered another call");
}

/// Threads of this process (entries of `/proc/self/task`; 0 when it cannot be read).
pub fn threads() -> usize {
    proc_self_entries("task")
}

/// Open descriptors of this process (entries of `/proc/self/fd`; 0 when it cannot be read).
pub fn open_fds() -> usize {
    proc_self_entries("fd")
}

fn proc_self_entries(dir: &str) -> usize {
    std::fs::read_dir(format!("/proc/self/{dir}")).map_or(0, |d| d.count())
}

/// Whether the tests run in the Soft-RoCE VM (sizes and counts scaled down there: the guest
/// runs under software emulation). `softroce/vm.sh` exports `SOFTROCE=1` to its programs.
/// Read once and cached: later calls do not touch the environment (reading it allocates, which
/// the allocation-counting tests would see).
pub fn in_vm() -> bool {
    static IN_VM: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *IN_VM.get_or_init(|| {
        std::env::var_os("SOFTROCE").is_some() || std::env::var_os("SOFTROCE_DEVICE").is_some()
    })
}

/// The largest payload of the echo tests: 64 MiB, 4 MiB in the VM.
pub fn max_payload() -> usize {
    if in_vm() { 4 << 20 } else { 64 << 20 }
}

/// Caps `n` at [`max_payload`].
pub fn scaled(n: usize) -> usize {
    n.min(max_payload())
}

/// A status assertion with context.
#[track_caller]
pub fn assert_code<T: std::fmt::Debug>(r: &Result<T, Status>, code: Code, what: &str) {
    match r {
        Err(s) if s.code() == code => {}
        other => panic!("{what}: expected {code:?}, got {other:?}"),
    }
}

// ----- payload patterns ----------------------------------------------------------------------

/// Length of the pattern table: not a power of two, so consecutive chunks of a large payload
/// (4 MiB RDMA chunks, pages) never hold the same bytes and a misplaced chunk is caught.
const TABLE_LEN: usize = (1 << 20) - 3;

fn table() -> &'static [u8] {
    static T: OnceLock<Vec<u8>> = OnceLock::new();
    T.get_or_init(|| {
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut v = Vec::with_capacity(TABLE_LEN + 8);
        while v.len() < TABLE_LEN {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.extend_from_slice(&x.to_le_bytes());
        }
        v.truncate(TABLE_LEN);
        v
    })
}

fn offset_of(seed: u64) -> usize {
    (seed.wrapping_mul(0x9e37_79b9) % TABLE_LEN as u64) as usize
}

/// `len` bytes of the pattern of `seed` (different seeds give different bytes).
pub fn pattern(len: usize, seed: u64) -> Bytes {
    let t = table();
    let mut v = Vec::with_capacity(len);
    let mut pos = offset_of(seed);
    while v.len() < len {
        let n = (len - v.len()).min(TABLE_LEN - pos);
        v.extend_from_slice(&t[pos..pos + n]);
        pos = 0;
    }
    Bytes::from(v)
}

/// Whether `data` is exactly the pattern of `seed` (of its length).
pub fn pattern_matches(data: &[u8], seed: u64) -> bool {
    first_mismatch(data, seed).is_none()
}

/// The first byte offset where `data` differs from the pattern of `seed`.
pub fn first_mismatch(data: &[u8], seed: u64) -> Option<usize> {
    let t = table();
    let mut pos = offset_of(seed);
    let mut off = 0;
    while off < data.len() {
        let n = (data.len() - off).min(TABLE_LEN - pos);
        if data[off..off + n] != t[pos..pos + n] {
            let i = (0..n).find(|&i| data[off + i] != t[pos + i]).unwrap_or(0);
            return Some(off + i);
        }
        off += n;
        pos = 0;
    }
    None
}

/// Checks a received blob: its sequence number, length and every byte.
#[track_caller]
pub fn check_blob(b: &Blob, seq: u64, len: usize, what: &str) {
    assert_eq!(b.seq, seq, "{what}: sequence number");
    assert_eq!(b.data.len(), len, "{what}: length");
    if let Some(i) = first_mismatch(&b.data, seq) {
        panic!("{what}: byte {i} of {len} differs from what was sent");
    }
}

/// Encoded length of a blob of `seq` with `n` data bytes.
pub fn blob_len(seq: u64, n: usize) -> usize {
    use prost::encoding::encoded_len_varint;
    let s = if seq == 0 {
        0
    } else {
        1 + encoded_len_varint(seq)
    };
    let d = if n == 0 {
        0
    } else {
        1 + encoded_len_varint(n as u64) + n
    };
    s + d
}

/// A blob of `seq` whose protobuf encoding is exactly `encoded` bytes (or the largest encoding
/// below it when that length cannot be hit exactly).
pub fn blob_of_encoded_len(seq: u64, encoded: usize) -> Blob {
    let mut n = encoded;
    while n > 0 && blob_len(seq, n) > encoded {
        n -= 1;
    }
    Blob {
        seq,
        data: pattern(n, seq),
    }
}

/// Bytes of the largest frame header: an eager frame carries at most `slot - MAX_HEADER_LEN`
/// bytes of metadata and payload.
pub const MAX_HEADER_LEN: usize = rpc_core::wire::MAX_HEADER_LEN;
/// The default slot size, the eager limit of a default connection.
pub const SLOT: usize = 8192;
/// The largest message (encoded) that goes eager on a default connection without metadata.
pub const EAGER_MAX: usize = SLOT - MAX_HEADER_LEN;

// ----- calls ---------------------------------------------------------------------------------

/// How a test makes its calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `Channel::unary` from a tokio task.
    Async,
    /// `Channel::unary_blocking` from a blocking thread.
    Blocking,
}

/// How long one call of a test may take before the test fails (the calls also carry a
/// deadline, so a blocking call cannot hang either).
pub const CALL_LIMIT: Duration = Duration::from_secs(60);

/// A unary call through `api`, bounded by [`CALL_LIMIT`]; sets a deadline on the request when
/// it has none.
pub async fn call<Req, Resp>(
    ch: &Channel,
    api: Api,
    method: &'static rpc_core::MethodDesc,
    mut req: Request<Req>,
) -> Result<Response<Resp>, Status>
where
    Req: prost::Message + Send + 'static,
    Resp: prost::Message + Default + Send + 'static,
{
    if req.timeout().is_none() {
        req.set_timeout(CALL_LIMIT - Duration::from_secs(5));
    }
    match api {
        Api::Async => within(CALL_LIMIT, method.path, ch.unary(method, req)).await,
        Api::Blocking => {
            let ch = ch.clone();
            blocking(CALL_LIMIT, method.path, move || {
                ch.unary_blocking(method, req)
            })
            .await
        }
    }
}

/// An echo of `len` pattern bytes tagged `seq` through `api` that must come back intact:
/// the channel still works (after a cancel, a failure, a forged peer...).
pub async fn echo_ok(ch: &Channel, api: Api, seq: u64, len: usize, what: &str) {
    let r: Response<Blob> = call(
        ch,
        api,
        &lab_server::ECHO,
        Request::new(Blob {
            seq,
            data: pattern(len, seq),
        }),
    )
    .await
    .unwrap_or_else(|e| panic!("{what}: {e:?}"));
    check_blob(r.get_ref(), seq, len, what);
}

/// `n` calls of mixed sizes (small, around the eager limit, rendezvous) with up to `depth` in
/// flight through one pipeline; every tag comes back once with its own payload.
pub fn pipeline_run(ch: &rpc_core::Channel, n: u64, depth: usize) {
    let mut p = ch
        .pipeline::<Blob, Blob>(&lab_server::ECHO)
        .expect("pipeline");
    let size = |seq: u64| match seq % 7 {
        0 => 0,
        1 => EAGER_MAX - 64,
        2 => scaled(300 << 10),
        _ => (seq % 200) as usize,
    };
    let mut seen = vec![false; n as usize];
    let mut next = 0u64;
    let mut done = 0u64;
    let started = Instant::now();
    while done < n {
        assert!(
            started.elapsed() < CALL_LIMIT,
            "pipeline: {done} of {n} done"
        );
        while next < n && p.in_flight() < depth {
            let mut req = Request::new(Blob {
                seq: next,
                data: pattern(size(next), next),
            });
            req.set_timeout(CALL_LIMIT);
            p.submit(next, req).expect("submit");
            next += 1;
        }
        if let Some((tag, r)) = p.wait() {
            let r = r.unwrap_or_else(|e| panic!("pipelined call {tag}: {e:?}"));
            check_blob(r.get_ref(), tag, size(tag), "pipelined echo");
            assert!(
                !std::mem::replace(&mut seen[tag as usize], true),
                "tag {tag} twice"
            );
            done += 1;
        }
    }
    assert_eq!(p.in_flight(), 0);
    assert!(p.wait().is_none() && p.poll().is_none(), "nothing left");
}
