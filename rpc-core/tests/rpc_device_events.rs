//! The device's asynchronous events reach the server's connections: a failed device closes
//! them, and the client's calls end `UNAVAILABLE` naming the cause. The soft provider raises
//! the event on request (`verbs::soft::fault::raise_async_event`, process-wide, hence a
//! binary of its own); on ib the same path reads `ibv_get_async_event`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::{Blob, SleepRequest, TestServer, lab_server, pattern, within};
use rpc_core::verbs::{AsyncEvent, ProviderKind};
use rpc_core::{ClientPoller, Code, Request, Response, Status};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_device_fails_the_connections_naming_the_cause() {
    if ProviderKind::from_env().ok() != Some(ProviderKind::Soft) {
        eprintln!("soft provider only: it raises the event on request");
        return;
    }
    let srv = TestServer::start().await;
    let ch = srv.channel(ClientPoller::Thread).await;
    let echo = |seq: u64| {
        let ch = ch.clone();
        async move {
            within(
                Duration::from_secs(20),
                "echo",
                ch.unary::<_, Blob>(
                    &lab_server::ECHO,
                    Request::new(Blob {
                        seq,
                        data: pattern(10, seq),
                    }),
                ),
            )
            .await
        }
    };
    let _: Response<Blob> = echo(1).await.unwrap();
    // A call in flight (its handler sleeps) when the device fails: it ends with the cause.
    let sleeping = {
        let ch = ch.clone();
        tokio::spawn(async move {
            let mut req = Request::new(SleepRequest {
                seq: 2,
                ms: 5_000,
                reply_len: 16,
                pad: bytes::Bytes::new(),
            });
            req.set_timeout(Duration::from_secs(30));
            ch.unary::<_, Blob>(&lab_server::SLEEP, req).await
        })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let start = Instant::now();
    rpc_core::verbs::soft::fault::raise_async_event(AsyncEvent::DeviceFatal);
    let st: Status = within(Duration::from_secs(20), "the call in flight ends", sleeping)
        .await
        .unwrap()
        .expect_err("the connection failed under the call");
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "it failed with the device, not with its handler: {:?}",
        start.elapsed()
    );
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(
        st.message().contains("device fatal error"),
        "the status names the cause: {st:?}"
    );
    // The soft device is not really dead: the channel reconnects and is served.
    let r: Response<Blob> = within(
        Duration::from_secs(20),
        "echo on a new connection",
        ch.unary(
            &lab_server::ECHO,
            Request::new(Blob {
                seq: 3,
                data: pattern(10, 3),
            }),
        ),
    )
    .await
    .unwrap();
    assert_eq!(r.get_ref().seq, 3);
}
