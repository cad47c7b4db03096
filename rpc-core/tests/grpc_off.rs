//! Without the `grpc` feature (`--no-default-features`): an HTTP/2 client on the bootstrap
//! port is closed with a log line, and the port keeps serving RDMA clients. With the feature
//! this file is empty (see `grpc_port.rs`).
#![cfg(not(feature = "grpc"))]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::{Blob, TestServer, lab_server, within};
use rpc_core::{ClientPoller, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const LIMIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_is_closed_and_rdma_still_served() {
    let srv = TestServer::start().await;
    let mut s = within(
        LIMIT,
        "tcp",
        tokio::net::TcpStream::connect(srv.server.local_addr()),
    )
    .await
    .unwrap();
    // The preface and an empty SETTINGS frame, as a gRPC client starts.
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
        .await
        .unwrap();
    let mut got = Vec::new();
    let _ = within(LIMIT, "the server closes", s.read_to_end(&mut got)).await;
    assert!(
        got.is_empty(),
        "nothing is sent to an HTTP/2 client: {got:?}"
    );

    let ch = srv.channel(ClientPoller::Thread).await;
    let r = within(
        LIMIT,
        "echo",
        ch.unary::<_, Blob>(&lab_server::ECHO, Request::new(Blob::default())),
    )
    .await
    .unwrap();
    assert_eq!(r.into_inner(), Blob::default());
    within(LIMIT, "shutdown", srv.server.shutdown()).await;
}
