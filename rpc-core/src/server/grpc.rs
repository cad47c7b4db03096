//! gRPC on the bootstrap port (feature `grpc`): HTTP/2 connections the acceptor tells from our
//! handshake go to one tonic server per [`RunningServer`](super::RunningServer), in the same
//! process, which serves `grpc.health.v1`, server reflection (v1 and v1alpha) and the tonic
//! services added with [`ServerBuilder::add_grpc_service`](super::ServerBuilder::add_grpc_service).
//!
//! ```text
//! acceptor: accept ─> peek first bytes ─┬─ HTTP/2 preface ─> mpsc ─> tonic (hyper) server
//!                                       └─ anything else ─> our handshake (or its refusal)
//! ```
//!
//! Shutdown: [`RunningServer::shutdown`](super::RunningServer::shutdown) first sets every
//! health status `NOT_SERVING` (so a probe sees the drain at once), keeps accepting HTTP/2
//! while the RDMA calls drain, then stops the tonic server gracefully (HTTP/2 GOAWAY, calls in
//! flight finish) within what is left of the grace period, at least [`MIN_CLOSE`], and closes
//! the connections still open after that.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, watch};
use tonic::body::Body;
use tonic::codegen::Service;
use tonic::codegen::http::{Request, Response};
use tonic::server::NamedService;
use tonic::service::Routes;
use tonic::transport::server::{Connected, TcpConnectInfo};
use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;
use tracing::{debug, warn};

use super::PeerSlot;

/// Accepted HTTP/2 connections waiting for the tonic server to take them.
const INTAKE_DEPTH: usize = 64;

/// The least time the tonic server gets to close gracefully at shutdown, even when the RDMA
/// drain used up the grace period (enough to send GOAWAY and answer what is in flight).
pub(crate) const MIN_CLOSE: Duration = Duration::from_millis(500);

/// How long the tonic server may take to end once its connections are closed by force.
const KILL_WAIT: Duration = Duration::from_secs(1);

/// The services this server answers for itself on the gRPC side.
const OWN_SERVICES: [&str; 3] = [
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// What a [`ServerBuilder`](super::ServerBuilder) collects for the gRPC side.
#[derive(Default)]
pub(crate) struct GrpcParts {
    routes: Routes,
    names: Vec<&'static str>,
    descriptors: Vec<&'static [u8]>,
    error: Option<String>,
}

impl std::fmt::Debug for GrpcParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcParts")
            .field("services", &self.names)
            .field("descriptor_sets", &self.descriptors.len())
            .finish()
    }
}

impl GrpcParts {
    /// Adds a tonic service; a second service of the same name (or one of ours) is an error
    /// `bind` reports.
    pub(crate) fn add<S>(&mut self, svc: S)
    where
        S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
            + NamedService
            + Clone
            + Send
            + Sync
            + 'static,
        S::Future: Send + 'static,
    {
        let name = S::NAME;
        if OWN_SERVICES.contains(&name) {
            self.error.get_or_insert_with(|| {
                format!("gRPC service {name} is served by the server itself; do not add it")
            });
            return;
        }
        if self.names.contains(&name) {
            self.error
                .get_or_insert_with(|| format!("gRPC service {name} added twice"));
            return;
        }
        self.names.push(name);
        self.routes = std::mem::take(&mut self.routes).add_service(svc);
    }

    pub(crate) fn add_descriptors(&mut self, encoded: &'static [u8]) {
        self.descriptors.push(encoded);
    }
}

/// Where a gRPC connection's life stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Serving,
    /// Graceful stop: GOAWAY, calls in flight finish.
    Closing,
    /// Connections still open are closed.
    Killed,
}

/// The `grpc.health.v1` statuses a running server reports (feature `grpc`), from
/// [`RunningServer::health`](super::RunningServer::health). Cheap to clone.
///
/// At bind every service added with [`add_service`](super::ServerBuilder::add_service) or
/// [`add_grpc_service`](super::ServerBuilder::add_grpc_service) is `SERVING` under its full
/// name (`package.Service`), and so is `""`, the whole server. When
/// [`RunningServer::shutdown`](super::RunningServer::shutdown) starts, every name known here
/// becomes `NOT_SERVING` before the drain begins; from then on [`Health::set_serving`] changes
/// nothing.
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
    shared: Arc<HealthShared>,
}

struct HealthShared {
    names: Mutex<BTreeSet<String>>,
    draining: AtomicBool,
}

impl std::fmt::Debug for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Health")
            .field("services", &*self.names())
            .field("draining", &self.shared.draining.load(Ordering::Acquire))
            .finish()
    }
}

impl Health {
    fn new(reporter: HealthReporter) -> Health {
        Health {
            reporter,
            shared: Arc::new(HealthShared {
                names: Mutex::new(BTreeSet::from([String::new()])),
                draining: AtomicBool::new(false),
            }),
        }
    }

    fn names(&self) -> std::sync::MutexGuard<'_, BTreeSet<String>> {
        self.shared.names.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reports `service` (a full name, or `""` for the whole server) as `SERVING`; does
    /// nothing once the server is shutting down.
    ///
    /// # Cancel safety
    /// Cancel safe: dropped before it completes, the status may or may not have changed.
    pub async fn set_serving(&self, service: impl AsRef<str>) {
        if self.shared.draining.load(Ordering::Acquire) {
            return;
        }
        self.set(service.as_ref(), ServingStatus::Serving).await;
    }

    /// Reports `service` (a full name, or `""` for the whole server) as `NOT_SERVING`.
    ///
    /// # Cancel safety
    /// As [`Health::set_serving`].
    pub async fn set_not_serving(&self, service: impl AsRef<str>) {
        self.set(service.as_ref(), ServingStatus::NotServing).await;
    }

    async fn set(&self, service: &str, status: ServingStatus) {
        self.names().insert(service.to_owned());
        self.reporter.set_service_status(service, status).await;
    }

    /// Marks the server draining: every name known goes `NOT_SERVING`.
    pub(crate) async fn drain(&self) {
        self.shared.draining.store(true, Ordering::Release);
        let names: Vec<String> = self.names().iter().cloned().collect();
        for name in names {
            self.reporter
                .set_service_status(&name, ServingStatus::NotServing)
                .await;
        }
    }
}

/// The gRPC side of a running server: the tonic server's task and its intake.
#[derive(Debug)]
pub(crate) struct GrpcSide {
    intake: Intake,
    health: Health,
    phase: watch::Sender<Phase>,
    task: Option<tokio::task::JoinHandle<()>>,
}

/// What the acceptor needs to hand a connection over.
#[derive(Clone, Debug)]
pub(crate) struct Intake {
    tx: mpsc::Sender<GrpcConn>,
    phase: watch::Receiver<Phase>,
}

impl GrpcSide {
    /// Sets up health (every name in `rdma` and in `parts` `SERVING`), reflection over the
    /// descriptor sets registered, and starts the tonic server on the current runtime.
    ///
    /// # Errors
    /// A configuration error: a gRPC service added twice or named like one of ours, a
    /// descriptor set that does not decode.
    pub(crate) async fn start(parts: GrpcParts, rdma: &[&'static str]) -> Result<Self, String> {
        if let Some(e) = parts.error {
            return Err(e);
        }
        let (reporter, health_server) = tonic_health::server::health_reporter();
        let health = Health::new(reporter);
        let served: BTreeSet<&str> = rdma.iter().chain(&parts.names).copied().collect();
        for name in &served {
            health.set(name, ServingStatus::Serving).await;
        }

        // Reflection lists the services this server offers (over RDMA or gRPC) that a
        // registered descriptor set describes, and its own.
        let mut described = BTreeSet::new();
        for (i, encoded) in parts.descriptors.iter().enumerate() {
            let fds = <prost_types::FileDescriptorSet as prost::Message>::decode(*encoded)
                .map_err(|e| {
                    format!("file descriptor set #{i} is not an encoded FileDescriptorSet: {e}")
                })?;
            for file in &fds.file {
                for svc in &file.service {
                    let name = svc.name();
                    described.insert(match file.package() {
                        "" => name.to_owned(),
                        p => format!("{p}.{name}"),
                    });
                }
            }
        }
        let listed: Vec<String> = served
            .iter()
            .filter(|n| described.contains(**n))
            .map(|n| (*n).to_owned())
            .chain(OWN_SERVICES.iter().map(|n| (*n).to_owned()))
            .collect();
        let reflection = || {
            let mut b = tonic_reflection::server::Builder::configure()
                .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
            for encoded in &parts.descriptors {
                b = b.register_encoded_file_descriptor_set(encoded);
            }
            for name in &listed {
                b = b.with_service_name(name.clone());
            }
            b
        };
        let v1 = reflection()
            .build_v1()
            .map_err(|e| format!("reflection: {e}"))?;
        let v1alpha = reflection()
            .build_v1alpha()
            .map_err(|e| format!("reflection: {e}"))?;
        let routes = parts
            .routes
            .add_service(health_server)
            .add_service(v1)
            .add_service(v1alpha);

        let (tx, rx) = mpsc::channel(INTAKE_DEPTH);
        let (phase, phase_rx) = watch::channel(Phase::Serving);
        let mut closing = phase_rx.clone();
        let signal = async move {
            let _ = closing.wait_for(|p| *p != Phase::Serving).await;
        };
        let task = tokio::spawn(async move {
            let served = tonic::transport::Server::builder()
                .add_routes(routes)
                .serve_with_incoming_shutdown(Incoming(rx), signal)
                .await;
            if let Err(e) = served {
                warn!("gRPC side of the bootstrap port stopped: {e}");
            }
        });
        Ok(GrpcSide {
            intake: Intake {
                tx,
                phase: phase_rx,
            },
            health,
            phase,
            task: Some(task),
        })
    }

    pub(crate) fn intake(&self) -> Intake {
        self.intake.clone()
    }

    pub(crate) fn health(&self) -> &Health {
        &self.health
    }

    /// Stops the tonic server: gracefully within `limit`, then by closing its connections.
    pub(crate) async fn stop(&mut self, limit: Duration) {
        let _ = self.phase.send(Phase::Closing);
        let Some(mut task) = self.task.take() else {
            return;
        };
        if tokio::time::timeout(limit, &mut task).await.is_ok() {
            let _ = self.phase.send(Phase::Killed);
            return;
        }
        debug!("gRPC connections still open after {limit:?}: closing them");
        let _ = self.phase.send(Phase::Killed);
        if tokio::time::timeout(KILL_WAIT, &mut task).await.is_err() {
            task.abort();
        }
    }
}

impl Drop for GrpcSide {
    fn drop(&mut self) {
        let _ = self.phase.send(Phase::Killed);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl Intake {
    /// Hands an HTTP/2 connection to the tonic server, which serves it from its first byte
    /// (the preface, still unread). Dropped, with a log line, when the server has stopped.
    pub(crate) async fn hand_over(&self, stream: TcpStream, slot: PeerSlot) {
        let peer = stream.peer_addr().ok();
        let mut phase = self.phase.clone();
        let conn = GrpcConn {
            stream,
            _slot: slot,
            killed: Box::pin(async move {
                let _ = phase.wait_for(|p| *p == Phase::Killed).await;
            }),
            dead: false,
        };
        if self.tx.send(conn).await.is_err() {
            debug!("gRPC connection from {peer:?} dropped: the gRPC side has stopped");
        }
    }
}

/// The accepted connections, as the stream tonic serves.
struct Incoming(mpsc::Receiver<GrpcConn>);

impl futures_core::Stream for Incoming {
    type Item = Result<GrpcConn, io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.0.poll_recv(cx).map(|c| c.map(Ok))
    }
}

/// An HTTP/2 connection: counted against its peer's connection limit while it lives, and
/// failed (reads and writes) once the server closes its gRPC side by force.
pub(crate) struct GrpcConn {
    stream: TcpStream,
    _slot: PeerSlot,
    killed: Pin<Box<dyn Future<Output = ()> + Send>>,
    /// `killed` completed (it must not be polled again).
    dead: bool,
}

impl std::fmt::Debug for GrpcConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrpcConn")
            .field("peer", &self.stream.peer_addr().ok())
            .finish()
    }
}

impl GrpcConn {
    fn check(&mut self, cx: &mut Context<'_>) -> io::Result<()> {
        if !self.dead && self.killed.as_mut().poll(cx).is_ready() {
            self.dead = true;
        }
        if self.dead {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "server shut down",
            ));
        }
        Ok(())
    }
}

impl Connected for GrpcConn {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.stream.connect_info()
    }
}

impl AsyncRead for GrpcConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for GrpcConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        this.check(cx)?;
        Pin::new(&mut this.stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}
