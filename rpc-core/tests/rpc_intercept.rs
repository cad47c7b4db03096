//! Interceptors in tonic's shape, on both sides: a generated server's `with_interceptor` runs
//! a function on each call's metadata before its handler (a refusal never reaches the
//! handler; added metadata does), and a channel's runs one before each call is sent (on
//! every call API). Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Blob, LabServer, LabState, LabSvc, lab_server, pattern, within};
use rpc_core::{Channel, Code, Request, Server, Status};

const LIMIT: Duration = Duration::from_secs(60);

/// Lets calls with `authorization: Bearer open-sesame` through, tagging them `x-checked`.
fn check(mut req: Request<()>) -> Result<Request<()>, Status> {
    match req.metadata().get_str("authorization") {
        Some("Bearer open-sesame") => {
            req.metadata_mut()
                .insert("x-checked", "yes")
                .map_err(|e| Status::internal(e.to_string()))?;
            Ok(req)
        }
        Some(_) => Err(Status::unauthenticated("bad token")),
        None => Err(Status::unauthenticated("no token")),
    }
}

fn blob(seq: u64) -> Request<Blob> {
    Request::new(Blob {
        seq,
        data: pattern(8, seq),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interceptors_refuse_and_add_metadata_on_both_sides() {
    common::init_logs();
    let state = LabState::new();
    let server = Server::builder()
        .add_service(LabServer::with_interceptor(
            LabSvc {
                state: std::sync::Arc::clone(&state),
            },
            check,
        ))
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let plain = within(
        LIMIT,
        "connect",
        Channel::connect(server.local_addr().to_string()),
    )
    .await
    .unwrap();

    // Refused by the server's interceptor: the handler never runs.
    let st = within(
        LIMIT,
        "meta",
        plain.unary::<_, Blob>(&lab_server::META, blob(1)),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), Code::Unauthenticated, "{st:?}");
    assert_eq!(st.message(), "no token");
    assert_eq!(state.calls.load(Ordering::Acquire), 0, "no handler ran");

    // The client's interceptor adds the token on every call API.
    let authed = plain.with_interceptor(|mut req: Request<()>| {
        req.metadata_mut()
            .insert("authorization", "Bearer open-sesame")
            .map_err(|e| Status::internal(e.to_string()))?;
        Ok(req)
    });
    let r = within(
        LIMIT,
        "meta",
        authed.unary::<_, Blob>(&lab_server::META, blob(2)),
    )
    .await
    .unwrap();
    assert_eq!(r.metadata().get_str("echo-x-checked"), Some("yes"));
    assert_eq!(
        r.metadata().get_str("echo-authorization"),
        Some("Bearer open-sesame")
    );
    let blocking = authed.clone();
    let r = tokio::task::spawn_blocking(move || {
        blocking.unary_blocking::<_, Blob>(&lab_server::META, blob(3))
    })
    .await
    .unwrap()
    .unwrap();
    assert_eq!(r.metadata().get_str("echo-x-checked"), Some("yes"));
    let piped = authed.clone();
    let got = tokio::task::spawn_blocking(move || {
        let mut p = piped.pipeline::<Blob, Blob>(&lab_server::META).unwrap();
        p.submit(4, blob(4)).unwrap();
        p.wait().expect("a finished call")
    })
    .await
    .unwrap();
    let (tag, r) = got;
    assert_eq!(tag, 4);
    assert_eq!(r.unwrap().metadata().get_str("echo-x-checked"), Some("yes"));
    // The generated client's `with_interceptor` is the same thing.
    let client =
        common::lab_client::LabClient::with_interceptor(plain.clone(), |mut req: Request<()>| {
            req.metadata_mut()
                .insert("authorization", "Bearer wrong")
                .map_err(|e| Status::internal(e.to_string()))?;
            Ok(req)
        });
    let st = within(LIMIT, "echo", client.echo(Blob::default()))
        .await
        .unwrap_err();
    assert_eq!(st.message(), "bad token", "{st:?}");
    let handled = state.calls.load(Ordering::Acquire);
    assert_eq!(handled, 3, "three calls passed the server's interceptor");

    // A client interceptor that refuses: nothing is sent.
    let refusing =
        plain.with_interceptor(|_req: Request<()>| Err(Status::permission_denied("not today")));
    let st = within(
        LIMIT,
        "refused",
        refusing.unary::<_, Blob>(&lab_server::META, blob(5)),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), Code::PermissionDenied);
    assert_eq!(st.message(), "not today");
    assert_eq!(server.live_calls(), 0);
    assert_eq!(state.calls.load(Ordering::Acquire), handled);
    within(LIMIT, "shutdown", server.shutdown()).await;
}
