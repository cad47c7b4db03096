//! Statuses and metadata as gRPC defines them, end to end: rich error details
//! (`grpc-status-details-bin`), binary `-bin` metadata both ways, printable ASCII values
//! elsewhere, and a handler's panic text kept on the server. Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{init_logs, within};
use rpc_core::server::{Dispatched, IncomingCall, Server, Service};
use rpc_core::{
    CallKind, Channel, Code, MethodDesc, Request, Response, STATUS_DETAILS_KEY, Status,
};

const LIMIT: Duration = Duration::from_secs(60);

static DETAILED: MethodDesc = MethodDesc::new("/test.Status/Detailed", CallKind::Unary);
static ECHO_META: MethodDesc = MethodDesc::new("/test.Status/EchoMeta", CallKind::Unary);
static LONG: MethodDesc = MethodDesc::new("/test.Status/Long", CallKind::Unary);
static METHODS: [MethodDesc; 3] = [DETAILED, ECHO_META, LONG];

#[derive(Clone, PartialEq, prost::Message)]
struct Msg {
    #[prost(bytes = "bytes", tag = "1")]
    data: Bytes,
}

/// An encoded `google.rpc.Status`-like blob: any bytes, including NUL and 0xff.
fn details() -> Vec<u8> {
    (0..=255u8).rev().chain(0..=255u8).collect()
}

struct StatusSvc;

impl Service for StatusSvc {
    fn name(&self) -> &'static str {
        "test.Status"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
        if method == DETAILED.id {
            call.unary(|_req: Request<Msg>| async move {
                let mut st =
                    Status::with_details(Code::InvalidArgument, "field 3 is bad", details());
                st.metadata_mut().insert("x-field", "3").unwrap();
                Err::<Response<Msg>, _>(st)
            })
        } else if method == ECHO_META.id {
            call.unary(|req: Request<Msg>| async move {
                let mut resp = Response::new(req.get_ref().clone());
                for (k, v) in req.metadata().iter() {
                    resp.metadata_mut()
                        .insert(format!("echo-{k}"), v.to_vec())
                        .unwrap();
                }
                Ok(resp)
            })
        } else if method == LONG.id {
            call.unary(|req: Request<Msg>| async move {
                // As many check marks (3 bytes each) as the request has bytes.
                let n = req.get_ref().data.len();
                Err::<Response<Msg>, _>(Status::internal("✓".repeat(n)))
            })
        } else {
            call.unimplemented()
        }
    }
}

async fn setup() -> (rpc_core::RunningServer, Channel) {
    init_logs();
    let server = Server::builder()
        .add_service(StatusSvc)
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let ch = within(
        LIMIT,
        "connect",
        Channel::connect(server.local_addr().to_string()),
    )
    .await
    .unwrap();
    (server, ch)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rich_error_details_reach_the_caller() {
    let (server, ch) = setup().await;
    let st = within(
        LIMIT,
        "call",
        ch.unary::<_, Msg>(&DETAILED, Request::new(Msg::default())),
    )
    .await
    .unwrap_err();
    assert_eq!(st.code(), Code::InvalidArgument);
    assert_eq!(st.message(), "field 3 is bad");
    assert_eq!(st.details(), &details()[..]);
    assert_eq!(st.metadata().get(STATUS_DETAILS_KEY), Some(&details()[..]));
    assert_eq!(st.metadata().get_str("x-field"), Some("3"));
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_metadata_goes_both_ways_under_bin_keys() {
    let (server, ch) = setup().await;
    let blob: Vec<u8> = (0..=255u8).collect();
    let mut req = Request::new(Msg {
        data: Bytes::from_static(b"x"),
    });
    req.metadata_mut()
        .insert_bin("trace-bin", blob.clone())
        .unwrap();
    req.metadata_mut().insert("tenant", "blue team").unwrap();
    // A binary value under an ASCII key is refused where it is made, as tonic refuses it.
    assert!(req.metadata_mut().insert("tenant", vec![0u8, 1]).is_err());
    let r = within(LIMIT, "call", ch.unary::<_, Msg>(&ECHO_META, req))
        .await
        .unwrap();
    assert_eq!(r.metadata().get("echo-trace-bin"), Some(&blob[..]));
    assert_eq!(r.metadata().get_str("echo-tenant"), Some("blue team"));
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_status_messages_arrive_whole_or_cut_at_a_character() {
    let (server, ch) = setup().await;
    for marks in [1002usize, 1365, 1366, 5000] {
        let req = Request::new(Msg {
            data: Bytes::from(vec![0u8; marks]),
        });
        let st = within(LIMIT, "call", ch.unary::<_, Msg>(&LONG, req))
            .await
            .unwrap_err();
        let want = "✓".repeat(marks);
        let got = st.message();
        if want.len() <= rpc_core::MAX_STATUS_MESSAGE_LEN {
            assert_eq!(got, want, "{marks} marks arrive whole");
        } else {
            assert!(
                want.starts_with(got)
                    && got.len() > rpc_core::MAX_STATUS_MESSAGE_LEN - 3
                    && got.len() <= rpc_core::MAX_STATUS_MESSAGE_LEN,
                "{marks} marks: cut at a character near the limit, got {} bytes",
                got.len()
            );
        }
        assert!(
            !got.contains('\u{fffd}'),
            "{marks}: no replacement character"
        );
    }
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_streaming_methods_are_named_by_path() {
    static NOPE: MethodDesc = MethodDesc::new("/test.Status/Nope", CallKind::ServerStreaming);
    let (server, ch) = setup().await;
    let st = match within(
        LIMIT,
        "call",
        ch.server_streaming::<_, Msg>(&NOPE, Request::new(Msg::default())),
    )
    .await
    {
        Err(st) => st,
        Ok(r) => {
            let mut s = r.into_inner();
            within(LIMIT, "the stream's end", s.message())
                .await
                .expect_err("no such method")
        }
    };
    assert_eq!(st.code(), Code::Unimplemented);
    assert_eq!(
        st.message(),
        "unknown method /test.Status/Nope: the server has no such method"
    );
    within(LIMIT, "shutdown", server.shutdown()).await;
}
