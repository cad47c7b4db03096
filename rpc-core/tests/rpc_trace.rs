//! Trace context across nested calls: a frontend's handler calls a backend; the caller's
//! `traceparent` reaches the frontend, which runs in a span of its own in the same trace, and
//! the backend gets the trace with the frontend's call as parent. Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{Blob, TestServer, init_logs, lab_server, pattern, within};
use rpc_core::trace::{TRACEPARENT, TraceContext};
use rpc_core::{Channel, ClientPoller, Request, Response, Server, Status};

const LIMIT: Duration = Duration::from_secs(60);

/// Relays a request to the backend's `Meta`, which answers with the metadata it got.
#[rpc_derive::service(package = "front")]
pub trait Front {
    /// Calls the backend; answers with what the backend saw and the context here.
    async fn relay(&self, request: Blob) -> Result<Blob, Status>;
}

struct FrontSvc {
    backend: Channel,
}

impl front_server::Front for FrontSvc {
    async fn relay(&self, request: Request<Blob>) -> Result<Response<Blob>, Status> {
        let here = TraceContext::current();
        let r = self
            .backend
            .unary::<_, Blob>(&lab_server::META, Request::new(request.into_inner()))
            .await?;
        let (md, b) = r.into_parts();
        let mut resp = Response::new(b);
        if let Some(seen) = md.get_str(&format!("echo-{TRACEPARENT}")) {
            resp.metadata_mut().insert("backend-saw", seen).unwrap();
        }
        if let Some(here) = here {
            resp.metadata_mut()
                .insert("front-ctx", here.to_string())
                .unwrap();
        }
        Ok(resp)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_follows_the_request_through_nested_calls() {
    init_logs();
    let backend = TestServer::start().await;
    let to_backend = backend.channel(ClientPoller::Thread).await;
    let front = Server::builder()
        .add_service(front_server::FrontServer::new(FrontSvc {
            backend: to_backend,
        }))
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let ch = within(
        LIMIT,
        "connect",
        Channel::connect(front.local_addr().to_string()),
    )
    .await
    .unwrap();
    let blob = || Blob {
        seq: 1,
        data: pattern(16, 1),
    };

    let root = TraceContext::new_root(true);
    let mut req = Request::new(blob());
    root.inject(req.metadata_mut());
    let r = within(
        LIMIT,
        "traced relay",
        ch.unary::<_, Blob>(&front_server::RELAY, req),
    )
    .await
    .unwrap();
    let front_ctx = TraceContext::parse(r.metadata().get_str("front-ctx").unwrap()).unwrap();
    let backend_saw = TraceContext::parse(r.metadata().get_str("backend-saw").unwrap()).unwrap();
    assert_eq!(
        front_ctx.trace_id(),
        root.trace_id(),
        "the frontend is in the trace"
    );
    assert_ne!(
        front_ctx.span_id(),
        root.span_id(),
        "with a span of its own"
    );
    assert!(front_ctx.sampled());
    assert_eq!(
        backend_saw.trace_id(),
        root.trace_id(),
        "the backend is in it too"
    );
    assert_ne!(backend_saw.span_id(), front_ctx.span_id());
    assert_ne!(backend_saw.span_id(), root.span_id());

    // Untraced: nothing is made up, nothing carried.
    let r = within(
        LIMIT,
        "plain relay",
        ch.unary::<_, Blob>(&front_server::RELAY, Request::new(blob())),
    )
    .await
    .unwrap();
    assert_eq!(r.metadata().get_str("front-ctx"), None);
    assert_eq!(r.metadata().get_str("backend-saw"), None);

    // A malformed traceparent is ignored (and passed on by nobody).
    let mut req = Request::new(blob());
    req.metadata_mut()
        .insert(TRACEPARENT, "00-zz-zz-01")
        .unwrap();
    let r = within(
        LIMIT,
        "bad relay",
        ch.unary::<_, Blob>(&front_server::RELAY, req),
    )
    .await
    .unwrap();
    assert_eq!(r.metadata().get_str("front-ctx"), None);
    assert_eq!(r.metadata().get_str("backend-saw"), None);
}

/// Names of the spans opened while it is the thread's subscriber.
#[derive(Clone, Default)]
struct Spans(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Spans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0
            .lock()
            .unwrap()
            .push(attrs.metadata().name().to_owned());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_call_runs_in_its_own_span() {
    use tracing_subscriber::layer::SubscriberExt as _;
    let backend = TestServer::start().await;
    let ch = backend.channel(ClientPoller::Thread).await;
    let spans = Spans::default();
    let seen = spans.clone();
    tokio::task::spawn_blocking(move || {
        let subscriber = tracing_subscriber::registry()
            .with(spans)
            .with(tracing_subscriber::filter::LevelFilter::DEBUG);
        tracing::subscriber::with_default(subscriber, || {
            ch.unary_blocking::<_, Blob>(
                &lab_server::ECHO,
                Request::new(Blob {
                    seq: 1,
                    data: pattern(8, 1),
                }),
            )
            .unwrap();
        });
    })
    .await
    .unwrap();
    let names = seen.0.lock().unwrap().clone();
    assert!(names.iter().any(|n| n == "rpc.client"), "{names:?}");
}
