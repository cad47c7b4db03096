//! The device's asynchronous events reach the connections: a failed device closes them on
//! the server and on the client, and the client's calls end `UNAVAILABLE` naming the cause.
//! The soft provider raises the event on request (`verbs::soft::fault::raise_async_event`,
//! process-wide, hence a binary of its own, and a server in a child process when the client's
//! device is the one that fails); on ib the same path reads `ibv_get_async_event`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::proc::{ChildProc, child_role, exit_with_parent, report};
use common::{Blob, SleepRequest, TestServer, echo_call, lab_server, within};
use rpc_core::verbs::{AsyncEvent, ProviderKind};
use rpc_core::{Channel, ClientPoller, Code, Request, Response, Status};

const ENTRY: &str = "child_process_entry";

/// Raised events go to whichever soft context polls first, process-wide: the tests that
/// raise one take turns.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Not a test: the body of the child server of `a_failed_client_device_...` (run with
/// `--ignored --exact`): serves `lab.Lab` and reports its address.
#[test]
#[ignore = "entry point of the child process of this binary's tests"]
fn child_process_entry() {
    if child_role().is_none() {
        eprintln!("child_process_entry only runs as a child process of this binary's tests");
        return;
    }
    exit_with_parent(Duration::from_secs(120));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let srv = TestServer::start().await;
        report("addr", srv.addr());
        std::future::pending::<()>().await;
    });
}

/// A call in flight on `ch` (its handler sleeps) when the soft device of this process fails:
/// it ends `UNAVAILABLE` naming the cause, at once; then the channel reconnects (the soft
/// device is not really dead) and is served.
async fn a_call_in_flight_fails_with_the_device(ch: &Channel, what: &str) {
    let echo = |seq: u64| echo_call(ch, seq);
    let _: Response<Blob> = echo(1).await.unwrap();
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
        "{what}: it failed with the device, not with its handler: {:?}",
        start.elapsed()
    );
    assert_eq!(st.code(), Code::Unavailable, "{what}: {st:?}");
    assert!(
        st.message().contains("device fatal error"),
        "{what}: the status names the cause: {st:?}"
    );
    let r: Response<Blob> = echo(3).await.expect("the channel reconnects");
    assert_eq!(r.get_ref().seq, 3);
}

/// The server's device fails (client and server share this process; the shard reads the
/// event first, as the client reads it only when idle).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_device_fails_the_connections_naming_the_cause() {
    if ProviderKind::from_env().ok() != Some(ProviderKind::Soft) {
        eprintln!("soft provider only: it raises the event on request");
        return;
    }
    let _turn = ONE_AT_A_TIME.lock().await;
    let srv = TestServer::start().await;
    let ch = srv.channel(ClientPoller::Thread).await;
    a_call_in_flight_fails_with_the_device(&ch, "server device").await;
}

/// The client's own device fails (the server, in another process, sees nothing): its calls in
/// flight end `UNAVAILABLE` naming the cause, on both pollers, and the channel reconnects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_client_device_fails_its_connection_naming_the_cause() {
    if ProviderKind::from_env().ok() != Some(ProviderKind::Soft) {
        eprintln!("soft provider only: it raises the event on request");
        return;
    }
    let _turn = ONE_AT_A_TIME.lock().await;
    common::init_logs();
    let mut child = ChildProc::spawn(ENTRY, "server", &[]);
    let addr = child.expect("addr", Duration::from_secs(60));
    for mode in [ClientPoller::Thread, ClientPoller::Caller] {
        let ch = within(
            Duration::from_secs(20),
            "connect",
            Channel::builder(&addr).poller(mode).connect(),
        )
        .await
        .unwrap();
        a_call_in_flight_fails_with_the_device(&ch, &format!("{mode:?}")).await;
    }
    child.kill();
}
