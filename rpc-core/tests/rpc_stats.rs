//! Call statistics: what a server ([`rpc_core::ServerBuilder::stats`]) and a channel
//! ([`rpc_core::Channel::with_stats`]) count per method, checked against the calls made, and
//! their export through the `metrics` facade. Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    Blob, FailRequest, GenRequest, SleepRequest, TestServer, lab_server, pattern, wait_until,
    within,
};
use rpc_core::{ClientPoller, Code, Request};

const LIMIT: Duration = Duration::from_secs(60);

fn blob(seq: u64, len: usize) -> Request<Blob> {
    Request::new(Blob {
        seq,
        data: pattern(len, seq),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_count_calls_statuses_bytes_and_latency() {
    let t = TestServer::start_with(|b| b.stats(true)).await;
    let plain = t.channel(ClientPoller::Thread).await;
    let ch = plain.with_stats();

    // 20 small echoes (eager both ways), 3 large responses (rendezvous), 4 failures.
    for i in 0..20 {
        within(
            LIMIT,
            "echo",
            ch.unary::<_, Blob>(&lab_server::ECHO, blob(i, 100)),
        )
        .await
        .unwrap();
    }
    for i in 0..3 {
        let req = Request::new(GenRequest {
            seq: i,
            len: 256 << 10,
        });
        within(
            LIMIT,
            "generate",
            ch.unary::<_, Blob>(&lab_server::GENERATE, req),
        )
        .await
        .unwrap();
    }
    for _ in 0..4 {
        let req = Request::new(FailRequest {
            code: Code::NotFound as u32,
            message: "no such thing".into(),
            ..FailRequest::default()
        });
        let st = within(LIMIT, "fail", ch.unary::<_, Blob>(&lab_server::FAIL, req))
            .await
            .unwrap_err();
        assert_eq!(st.code(), Code::NotFound);
    }
    // A call on the plain channel is counted by the server only.
    within(
        LIMIT,
        "echo",
        plain.unary::<_, Blob>(&lab_server::ECHO, blob(99, 10)),
    )
    .await
    .unwrap();

    // Two sleeping calls are in flight on both sides until they end.
    let sleeper = |seq| {
        let ch = ch.clone();
        tokio::spawn(async move {
            let req = Request::new(SleepRequest {
                seq,
                ms: 300,
                reply_len: 8,
                ..SleepRequest::default()
            });
            ch.unary::<_, Blob>(&lab_server::SLEEP, req).await
        })
    };
    let (a, b) = (sleeper(1), sleeper(2));
    let server = &t.server;
    wait_until(LIMIT, "two sleepers in flight", || {
        server
            .stats()
            .method(lab_server::SLEEP.path)
            .is_some_and(|m| m.in_flight() == 2)
    })
    .await;
    let live = ch.stats();
    assert_eq!(live.method(lab_server::SLEEP.path).unwrap().in_flight(), 2);
    a.await.unwrap().unwrap();
    b.await.unwrap().unwrap();
    t.settle("calls end").await;

    let srv = t.server.stats();
    let cli = ch.stats();
    println!("{srv}\n{cli}");
    assert_eq!(srv.side, "server");
    assert_eq!(cli.side, "client");

    let echo = srv.method(lab_server::ECHO.path).unwrap();
    assert_eq!(
        (echo.started, echo.count(Code::Ok), echo.in_flight()),
        (21, 21, 0)
    );
    assert!(echo.request_bytes >= 21 * 10, "{echo:?}");
    assert_eq!(echo.rendezvous_responses, 0);
    let c_echo = cli.method(lab_server::ECHO.path).unwrap();
    assert_eq!((c_echo.started, c_echo.count(Code::Ok)), (20, 20));

    let generate = srv.method(lab_server::GENERATE.path).unwrap();
    assert_eq!(generate.count(Code::Ok), 3);
    assert_eq!(generate.rendezvous_responses, 3, "{generate:?}");
    assert!(generate.response_bytes >= 3 * (256 << 10), "{generate:?}");

    for s in [&srv, &cli] {
        let fail = s.method(lab_server::FAIL.path).unwrap();
        assert_eq!(fail.count(Code::NotFound), 4, "{} {fail:?}", s.side);
        assert_eq!(fail.count(Code::Ok), 0);
        assert_eq!(
            fail.statuses().collect::<Vec<_>>(),
            vec![(Code::NotFound, 4)]
        );
        let sleep = s.method(lab_server::SLEEP.path).unwrap();
        assert_eq!((sleep.finished(), sleep.in_flight()), (2, 0), "{}", s.side);
        // Each slept 300 ms: the latency says so (buckets are 12.5% wide).
        assert!(
            sleep.latency.quantile(0.5) >= Duration::from_millis(250),
            "{} {:?}",
            s.side,
            sleep.latency.quantile(0.5)
        );
        assert_eq!(sleep.latency.count(), 2);
        assert!(s.to_string().contains(lab_server::SLEEP.path));
    }
    assert_eq!(srv.transport.connections, 1);
    assert_eq!(srv.transport.connection_failures, 0);
    assert_eq!(cli.transport.connections, 1);
    assert_eq!(cli.transport.reconnects, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_by_default_and_reconnects_are_counted() {
    let t = TestServer::start().await;
    let addr = t.addr();
    let ch = t.channel(ClientPoller::Thread).await.with_stats();
    within(
        LIMIT,
        "echo",
        ch.unary::<_, Blob>(&lab_server::ECHO, blob(1, 8)),
    )
    .await
    .unwrap();
    assert!(t.server.stats().methods.is_empty(), "the server keeps none");
    t.server.shutdown().await;
    wait_until(LIMIT, "the client sees the loss", || !ch.is_connected()).await;
    let _t2 = TestServer::bind_with(&addr, |b| b.stats(true)).await;
    within(LIMIT, "echo after restart", async {
        loop {
            match ch.unary::<_, Blob>(&lab_server::ECHO, blob(2, 8)).await {
                Ok(_) => break,
                Err(st) => assert_eq!(st.code(), Code::Unavailable, "{st:?}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let s = ch.stats();
    assert_eq!(s.transport.reconnects, 1, "{s}");
    assert_eq!(s.transport.connections, 2, "{s}");
    let echo = s.method(lab_server::ECHO.path).unwrap();
    assert!(echo.count(Code::Ok) >= 2, "{echo:?}");
}

/// A `metrics` recorder that keeps the last value of every counter and gauge.
#[derive(Default, Clone)]
struct Capture(Arc<Mutex<HashMap<String, f64>>>);

struct Value(String, Arc<Mutex<HashMap<String, f64>>>);

impl metrics::CounterFn for Value {
    fn increment(&self, v: u64) {
        *self.1.lock().unwrap().entry(self.0.clone()).or_default() += v as f64;
    }
    fn absolute(&self, v: u64) {
        self.1.lock().unwrap().insert(self.0.clone(), v as f64);
    }
}

impl metrics::GaugeFn for Value {
    fn increment(&self, v: f64) {
        *self.1.lock().unwrap().entry(self.0.clone()).or_default() += v;
    }
    fn decrement(&self, v: f64) {
        *self.1.lock().unwrap().entry(self.0.clone()).or_default() -= v;
    }
    fn set(&self, v: f64) {
        self.1.lock().unwrap().insert(self.0.clone(), v);
    }
}

impl Capture {
    fn name(key: &metrics::Key) -> String {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        format!("{}{{{}}}", key.name(), labels.join(","))
    }
}

impl metrics::Recorder for Capture {
    fn describe_counter(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_gauge(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn describe_histogram(
        &self,
        _: metrics::KeyName,
        _: Option<metrics::Unit>,
        _: metrics::SharedString,
    ) {
    }
    fn register_counter(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Counter {
        metrics::Counter::from_arc(Arc::new(Value(Capture::name(key), Arc::clone(&self.0))))
    }
    fn register_gauge(&self, key: &metrics::Key, _: &metrics::Metadata<'_>) -> metrics::Gauge {
        metrics::Gauge::from_arc(Arc::new(Value(Capture::name(key), Arc::clone(&self.0))))
    }
    fn register_histogram(
        &self,
        _: &metrics::Key,
        _: &metrics::Metadata<'_>,
    ) -> metrics::Histogram {
        metrics::Histogram::noop()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exported_through_the_metrics_facade() {
    let t = TestServer::start_with(|b| b.stats(true)).await;
    let ch = t.channel(ClientPoller::Thread).await.with_stats();
    for i in 0..5 {
        within(
            LIMIT,
            "echo",
            ch.unary::<_, Blob>(&lab_server::ECHO, blob(i, 8)),
        )
        .await
        .unwrap();
    }
    t.settle("calls end").await;
    let capture = Capture::default();
    metrics::with_local_recorder(&capture, || {
        t.server.stats().export();
        ch.stats().export();
    });
    let got = capture.0.lock().unwrap().clone();
    let path = lab_server::ECHO.path;
    for side in ["server", "client"] {
        let key = format!("rpc_calls_total{{code=OK,method={path},side={side}}}");
        assert_eq!(got.get(&key), Some(&5.0), "{key} in {got:#?}");
        let key = format!("rpc_calls_in_flight{{method={path},side={side}}}");
        assert_eq!(got.get(&key), Some(&0.0), "{key}");
        let key = format!("rpc_latency_seconds{{method={path},quantile=0.99,side={side}}}");
        assert!(got.get(&key).is_some_and(|v| *v > 0.0), "{key}");
    }
    assert_eq!(got.get("rpc_connections_total{side=server}"), Some(&1.0));
}
