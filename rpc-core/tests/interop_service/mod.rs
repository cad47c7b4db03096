//! The interop test service, shaped after gRPC's `grpc.testing.TestService`
//! (`src/proto/grpc/testing/{test,messages}.proto`): the same methods, the same message fields
//! that the interop cases use, and a server that behaves like gRPC's reference
//! `TestServiceImpl` (responses of the requested sizes, an echoed status, echoed metadata).
//!
//! Differences from gRPC's, all deliberate:
//! - Payload bodies carry a pattern derived from their length (not zeros), and the server
//!   checks every request payload: corruption, truncation or reordering of a large message
//!   becomes `DATA_LOSS` instead of passing unnoticed.
//! - The server keeps [`Probes`]: how many handlers started and how many were dropped without
//!   finishing, so cancellation tests can see what the server saw.
//! - Every test runs against the provider `RPC_PROVIDER` names (soft when unset), like the rest
//!   of the suite, so the same binary runs on `ib` in the Soft-RoCE VM.
#![allow(dead_code)]

#[path = "../common/remote.rs"]
pub mod remote;

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_core::Stream;
use rpc_core::server::RunningServer;
use rpc_core::{Channel, Code, Metadata, Request, Response, Server, Status, Streaming};

/// The longest any single wait in these tests may take before the test fails as a hang. Generous:
/// the suite must pass on a loaded 2-core machine and inside a VM.
pub const HANG: Duration = Duration::from_secs(30);

/// Request metadata the server echoes as response metadata (gRPC's key).
pub const ECHO_INITIAL: &str = "x-grpc-test-echo-initial";
/// Request metadata the server echoes as trailers of its status (gRPC's key).
pub const ECHO_TRAILING: &str = "x-grpc-test-echo-trailing-bin";

// ----- messages (field numbers as in grpc/testing/messages.proto) ------------------------------

/// `grpc.testing.Empty`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Empty {}

/// `grpc.testing.Payload`: only the body (the compressable type is always the same here).
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payload {
    #[prost(bytes = "bytes", tag = "2")]
    pub body: Bytes,
}

/// `grpc.testing.EchoStatus`: the status the server must end the call with.
#[derive(Clone, PartialEq, prost::Message)]
pub struct EchoStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
    #[prost(string, tag = "2")]
    pub message: String,
}

/// `grpc.testing.SimpleRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SimpleRequest {
    #[prost(int32, tag = "2")]
    pub response_size: i32,
    #[prost(message, optional, tag = "3")]
    pub payload: Option<Payload>,
    #[prost(message, optional, tag = "7")]
    pub response_status: Option<EchoStatus>,
}

/// `grpc.testing.SimpleResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SimpleResponse {
    #[prost(message, optional, tag = "1")]
    pub payload: Option<Payload>,
}

/// `grpc.testing.StreamingInputCallRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamingInputCallRequest {
    #[prost(message, optional, tag = "1")]
    pub payload: Option<Payload>,
}

/// `grpc.testing.StreamingInputCallResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamingInputCallResponse {
    #[prost(int32, tag = "1")]
    pub aggregated_payload_size: i32,
}

/// `grpc.testing.ResponseParameters`: one response of a streaming call.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ResponseParameters {
    #[prost(int32, tag = "1")]
    pub size: i32,
    /// Delay before sending this response, in microseconds.
    #[prost(int32, tag = "2")]
    pub interval_us: i32,
}

/// `grpc.testing.StreamingOutputCallRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamingOutputCallRequest {
    #[prost(message, repeated, tag = "2")]
    pub response_parameters: Vec<ResponseParameters>,
    #[prost(message, optional, tag = "3")]
    pub payload: Option<Payload>,
    #[prost(message, optional, tag = "7")]
    pub response_status: Option<EchoStatus>,
}

/// `grpc.testing.StreamingOutputCallResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StreamingOutputCallResponse {
    #[prost(message, optional, tag = "1")]
    pub payload: Option<Payload>,
}

/// `grpc.testing.TestService` (the methods the interop cases call).
#[rpc_derive::service(package = "grpc.testing")]
pub trait TestService {
    /// One empty request, one empty response.
    async fn empty_call(&self, request: Empty) -> Result<Empty, Status>;
    /// One request, one response of `response_size` bytes.
    async fn unary_call(&self, request: SimpleRequest) -> Result<SimpleResponse, Status>;
    /// One request, one response per `response_parameters` entry.
    type Output: Stream<Item = Result<StreamingOutputCallResponse, Status>>;
    async fn streaming_output_call(
        &self,
        request: StreamingOutputCallRequest,
    ) -> Result<Self::Output, Status>;
    /// A stream of requests, one response with the total payload size.
    async fn streaming_input_call(
        &self,
        request: Streaming<StreamingInputCallRequest>,
    ) -> Result<StreamingInputCallResponse, Status>;
    /// Each request is answered as it arrives.
    async fn full_duplex_call(
        &self,
        request: Streaming<StreamingOutputCallRequest>,
    ) -> Result<Self::Output, Status>;
    /// Requests are buffered until the client half-closes, then answered in order.
    async fn half_duplex_call(
        &self,
        request: Streaming<StreamingOutputCallRequest>,
    ) -> Result<Self::Output, Status>;
}

/// `grpc.testing.UnimplementedService`: a service no test server registers.
#[rpc_derive::service(package = "grpc.testing")]
pub trait UnimplementedService {
    /// Never implemented by the server.
    async fn unimplemented_call(&self, request: Empty) -> Result<Empty, Status>;
}

// ----- payloads ---------------------------------------------------------------------------------

fn pattern_byte(len: usize, i: usize) -> u8 {
    let x = (i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ (len as u64).rotate_left(17);
    (x >> 29) as u8
}

/// A payload of `len` bytes whose content depends on its length and on each byte's position.
pub fn payload(len: usize) -> Payload {
    Payload {
        body: (0..len)
            .map(|i| pattern_byte(len, i))
            .collect::<Vec<u8>>()
            .into(),
    }
}

/// Whether `body` is exactly what [`payload`] makes for its length.
pub fn intact(body: &[u8]) -> bool {
    body.iter()
        .enumerate()
        .all(|(i, &b)| b == pattern_byte(body.len(), i))
}

/// The body of an optional payload, checked; its length.
pub fn checked_len(p: Option<&Payload>) -> Result<usize, Status> {
    let body = p.map_or(&[][..], |p| &p.body[..]);
    if intact(body) {
        Ok(body.len())
    } else {
        Err(Status::data_loss(format!(
            "a {}-byte payload arrived corrupted",
            body.len()
        )))
    }
}

fn size(n: i32) -> Result<usize, Status> {
    usize::try_from(n).map_err(|_| Status::invalid_argument(format!("negative size {n}")))
}

// ----- probes -----------------------------------------------------------------------------------

/// What the server saw: handlers started, finished, dropped before finishing.
#[derive(Debug, Default)]
pub struct Probes {
    pub started: AtomicU64,
    pub finished: AtomicU64,
    pub dropped: AtomicU64,
}

impl Probes {
    /// Handlers (and their response streams) dropped before they finished.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::SeqCst)
    }

    /// Handlers started.
    pub fn started(&self) -> u64 {
        self.started.load(Ordering::SeqCst)
    }

    /// Waits (bounded) until `f` holds.
    pub async fn until(&self, what: &str, f: impl Fn(&Probes) -> bool) {
        let t0 = std::time::Instant::now();
        while !f(self) {
            assert!(
                t0.elapsed() < HANG,
                "timed out waiting for: {what} ({self:?})"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// Moved into a handler's future or response stream: counts it as dropped unless it was marked
/// finished first.
pub struct Guard {
    probes: Arc<Probes>,
    done: bool,
}

impl Guard {
    fn new(probes: &Arc<Probes>) -> Guard {
        probes.started.fetch_add(1, Ordering::SeqCst);
        Guard {
            probes: Arc::clone(probes),
            done: false,
        }
    }

    fn finish(&mut self) {
        if !self.done {
            self.done = true;
            self.probes.finished.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if !self.done {
            self.probes.dropped.fetch_add(1, Ordering::SeqCst);
        }
    }
}

// ----- the server -------------------------------------------------------------------------------

/// The reference implementation of [`TestService`] (the tonic-shaped trait, for metadata).
#[derive(Clone, Default)]
pub struct Interop {
    pub probes: Arc<Probes>,
}

type Out = Pin<Box<dyn Stream<Item = Result<StreamingOutputCallResponse, Status>> + Send>>;

/// The status a request asks for (`None` for OK), with the echoed trailers.
fn echo_status(s: Option<&EchoStatus>, md: &Metadata) -> Option<Status> {
    let s = s.filter(|s| s.code != 0)?;
    let code = u8::try_from(s.code).map_or(Code::Unknown, Code::from_u8);
    let mut st = Status::new(code, s.message.clone());
    if let Some(v) = md.get(ECHO_TRAILING) {
        let _ = st.metadata_mut().insert(ECHO_TRAILING, v.to_vec());
    }
    Some(st)
}

/// Response metadata echoing the request's initial-metadata entry.
fn echo_initial(md: &Metadata) -> Metadata {
    let mut out = Metadata::new();
    if let Some(v) = md.get(ECHO_INITIAL) {
        let _ = out.insert(ECHO_INITIAL, v.to_vec());
    }
    out
}

fn respond(p: &ResponseParameters) -> Result<StreamingOutputCallResponse, Status> {
    Ok(StreamingOutputCallResponse {
        payload: Some(payload(size(p.size)?)),
    })
}

async fn pause(p: &ResponseParameters) {
    if p.interval_us > 0 {
        tokio::time::sleep(Duration::from_micros(p.interval_us as u64)).await;
    }
}

/// The state of a full- or half-duplex response stream.
struct Duplex {
    requests: Option<Streaming<StreamingOutputCallRequest>>,
    queue: VecDeque<ResponseParameters>,
    /// The status the call ends with once `queue` is sent.
    end: Option<Status>,
    trailers: Metadata,
    /// Half duplex: read every request before answering.
    buffer_all: bool,
    guard: Guard,
}

impl Duplex {
    async fn next(mut self) -> Option<(Result<StreamingOutputCallResponse, Status>, Duplex)> {
        loop {
            let reading = self.requests.is_some() && self.end.is_none();
            if !(reading && self.buffer_all)
                && let Some(p) = self.queue.pop_front()
            {
                pause(&p).await;
                return Some((respond(&p), self));
            }
            if let Some(status) = self.end.take() {
                self.guard.finish();
                self.requests = None;
                return Some((Err(status), self));
            }
            let Some(requests) = self.requests.as_mut() else {
                self.guard.finish();
                return None;
            };
            match requests.message().await {
                Ok(Some(req)) => {
                    if let Err(e) = checked_len(req.payload.as_ref()) {
                        self.end = Some(e);
                        continue;
                    }
                    self.queue.extend(req.response_parameters.iter().cloned());
                    self.end = echo_status(req.response_status.as_ref(), &self.trailers);
                }
                Ok(None) => self.requests = None,
                Err(e) => {
                    self.end = Some(e);
                    self.requests = None;
                }
            }
        }
    }
}

impl Interop {
    fn duplex(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
        buffer_all: bool,
    ) -> Response<Out> {
        let guard = Guard::new(&self.probes);
        let (md, requests, _) = request.into_parts();
        let state = Duplex {
            requests: Some(requests),
            queue: VecDeque::new(),
            end: None,
            trailers: md.clone(),
            buffer_all,
            guard,
        };
        let s: Out = Box::pin(futures_util::stream::unfold(state, Duplex::next));
        Response::from_parts(echo_initial(&md), s)
    }
}

impl test_service_server::TestService for Interop {
    async fn empty_call(&self, _request: Request<Empty>) -> Result<Response<Empty>, Status> {
        Ok(Response::new(Empty {}))
    }

    async fn unary_call(
        &self,
        request: Request<SimpleRequest>,
    ) -> Result<Response<SimpleResponse>, Status> {
        let mut guard = Guard::new(&self.probes);
        let md = request.metadata().clone();
        let req = request.into_inner();
        checked_len(req.payload.as_ref())?;
        if let Some(st) = echo_status(req.response_status.as_ref(), &md) {
            guard.finish();
            return Err(st);
        }
        let body = payload(size(req.response_size)?);
        guard.finish();
        Ok(Response::from_parts(
            echo_initial(&md),
            SimpleResponse {
                payload: Some(body),
            },
        ))
    }

    type StreamingOutputCallStream = Out;

    async fn streaming_output_call(
        &self,
        request: Request<StreamingOutputCallRequest>,
    ) -> Result<Response<Out>, Status> {
        let guard = Guard::new(&self.probes);
        let md = request.metadata().clone();
        let req = request.into_inner();
        checked_len(req.payload.as_ref())?;
        let end = echo_status(req.response_status.as_ref(), &md);
        let state = (VecDeque::from(req.response_parameters), end, guard, false);
        let s: Out = Box::pin(futures_util::stream::unfold(
            state,
            |(mut queue, mut end, mut guard, over)| async move {
                if over {
                    return None;
                }
                if let Some(p) = queue.pop_front() {
                    pause(&p).await;
                    return Some((respond(&p), (queue, end, guard, false)));
                }
                guard.finish();
                end.take().map(|st| (Err(st), (queue, None, guard, true)))
            },
        ));
        Ok(Response::from_parts(echo_initial(&md), s))
    }

    async fn streaming_input_call(
        &self,
        request: Request<Streaming<StreamingInputCallRequest>>,
    ) -> Result<Response<StreamingInputCallResponse>, Status> {
        let mut guard = Guard::new(&self.probes);
        let mut requests = request.into_inner();
        let mut total = 0usize;
        while let Some(m) = requests.message().await? {
            total += checked_len(m.payload.as_ref())?;
        }
        guard.finish();
        let aggregated_payload_size = i32::try_from(total)
            .map_err(|_| Status::out_of_range("aggregated payload size over 2 GiB"))?;
        Ok(Response::new(StreamingInputCallResponse {
            aggregated_payload_size,
        }))
    }

    type FullDuplexCallStream = Out;

    async fn full_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Out>, Status> {
        Ok(self.duplex(request, false))
    }

    type HalfDuplexCallStream = Out;

    async fn half_duplex_call(
        &self,
        request: Request<Streaming<StreamingOutputCallRequest>>,
    ) -> Result<Response<Out>, Status> {
        Ok(self.duplex(request, true))
    }
}

// ----- helpers ----------------------------------------------------------------------------------

/// A running interop server, a channel to it and its probes.
pub struct Env {
    /// The server, when it runs in this process (`None` across two hosts).
    pub server: Option<RunningServer>,
    pub channel: Channel,
    pub client: test_service_client::TestServiceClient,
    pub probes: Arc<Probes>,
}

/// The interop server's slot across two hosts (`remote`): one server, on the base port.
pub const SLOT: remote::Slot = remote::Slot {
    offset: 0,
    config: |b| b,
};

fn init_logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// A server with the interop service on `addr`, and its probes.
pub async fn bind(addr: &str) -> (RunningServer, Arc<Probes>) {
    init_logs();
    let svc = Interop::default();
    let probes = Arc::clone(&svc.probes);
    let server = Server::builder()
        .add_service(test_service_server::TestServiceServer::new(svc))
        .bind(addr)
        .await
        .expect("bind the interop server");
    (server, probes)
}

impl Env {
    /// Connects to the interop server: the remote one when `RPC_TEST_REMOTE` is set (two
    /// hosts, see `remote`), else one started here on an ephemeral port.
    pub async fn start() -> Env {
        init_logs();
        if let Some(addr) = remote::remote_addr(&SLOT) {
            remote::wait_listening(&addr).await;
            let channel = within("connect", Channel::connect(addr))
                .await
                .expect("connect to the remote interop server");
            return Env {
                client: test_service_client::TestServiceClient::new(channel.clone()),
                channel,
                server: None,
                probes: Arc::default(),
            };
        }
        Env::start_local().await
    }

    /// Starts a server here (also across two hosts: for the cases that read the server's
    /// [`Probes`]) and connects to it.
    pub async fn start_local() -> Env {
        let (server, probes) = bind("127.0.0.1:0").await;
        let channel = within("connect", Channel::connect(server.local_addr().to_string()))
            .await
            .expect("connect to the interop server");
        Env {
            client: test_service_client::TestServiceClient::new(channel.clone()),
            channel,
            server: Some(server),
            probes,
        }
    }

    /// Waits (bounded) until the server has no call left, then stops it.
    pub async fn finish(self) {
        // (A remote server checks its live calls when it ends.)
        if let Some(server) = &self.server {
            let t0 = std::time::Instant::now();
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

/// Awaits `f`, failing the test if it takes longer than [`HANG`].
pub async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(HANG, f).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no answer within {HANG:?} (hang)"),
    }
}

/// A stream fed through a channel, for tests that interleave sending and receiving.
pub fn channel_stream<T: Send + 'static>(
    depth: usize,
) -> (
    tokio::sync::mpsc::Sender<T>,
    impl Stream<Item = T> + Send + 'static,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel(depth);
    (
        tx,
        futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx)),
    )
}

/// Response parameters for sizes, with no delay.
pub fn sizes(sizes: &[usize]) -> Vec<ResponseParameters> {
    sizes
        .iter()
        .map(|&s| ResponseParameters {
            size: s as i32,
            interval_us: 0,
        })
        .collect()
}
