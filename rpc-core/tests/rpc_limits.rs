//! Limits that protect a server: a peer address that opens connections up to
//! `max_connections_per_peer` gets a clear `RESOURCE_EXHAUSTED` refusal, the connections it
//! holds keep being served, and a closed one frees its place. Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{TestServer, echo_seq, within};
use rpc_core::Code;

const LIMIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_past_its_connection_limit_is_refused_and_the_others_are_served() {
    let srv = TestServer::start_with(|b| b.max_connections_per_peer(2)).await;
    let a = srv.channel(rpc_core::ClientPoller::Thread).await;
    let b = srv.channel(rpc_core::ClientPoller::Thread).await;
    let e = within(LIMIT, "third connect", srv.builder().connect())
        .await
        .expect_err("the third connection from one address is refused");
    assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
    assert!(
        e.to_string()
            .contains("too many connections from 127.0.0.1"),
        "the refusal says why: {e}"
    );
    echo_seq(&a, 1).await;
    echo_seq(&b, 2).await;
    // A closed connection frees its place (the server sees the close shortly after).
    drop(a);
    let start = Instant::now();
    let c = loop {
        match srv.builder().connect().await {
            Ok(c) => break c,
            Err(e) if start.elapsed() < Duration::from_secs(20) => {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("the place was not freed: {e}"),
        }
    };
    echo_seq(&c, 3).await;
    echo_seq(&b, 4).await;
}
