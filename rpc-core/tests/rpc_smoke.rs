//! First end-to-end check of the runtime with a hand-written service.

use bytes::Bytes;
use rpc_core::server::{Dispatched, IncomingCall, Server, Service};
use rpc_core::{CallKind, Channel, MethodDesc, Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
struct Echo {
    #[prost(uint64, tag = "1")]
    seq: u64,
    #[prost(bytes = "bytes", tag = "2")]
    data: Bytes,
}

static ECHO: MethodDesc = MethodDesc::new("/test.Echo/Echo", CallKind::Unary);
static FAIL: MethodDesc = MethodDesc::new("/test.Echo/Fail", CallKind::Unary);
static METHODS: [MethodDesc; 2] = [ECHO, FAIL];

struct EchoSvc;

impl Service for EchoSvc {
    fn name(&self) -> &'static str {
        "test.Echo"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
        if method == ECHO.id {
            call.unary(|req: Request<Echo>| async move { Ok(Response::new(req.into_inner())) })
        } else if method == FAIL.id {
            call.unary(|_req: Request<Echo>| async move {
                Err::<Response<Echo>, _>(Status::not_found("nothing here"))
            })
        } else {
            call.unimplemented()
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_round_trips() {
    let _ = tracing_subscriber::fmt().with_env_filter("info").try_init();
    let server = Server::builder().add_service(EchoSvc).bind("127.0.0.1:0").await.unwrap();
    let ch = Channel::connect(server.local_addr().to_string()).await.unwrap();
    for (i, size) in [0usize, 10, 1000, 7000, 9000, 100_000, 5 << 20].into_iter().enumerate() {
        let msg = Echo { seq: i as u64, data: Bytes::from(vec![i as u8; size]) };
        let r: Response<Echo> =
            tokio::time::timeout(std::time::Duration::from_secs(10), ch.unary(&ECHO, Request::new(msg.clone())))
                .await
                .expect("no hang")
                .unwrap();
        assert_eq!(r.into_inner(), msg, "size {size}");
    }
    let e = ch.unary::<_, Echo>(&FAIL, Request::new(Echo::default())).await.unwrap_err();
    assert_eq!(e.code(), rpc_core::Code::NotFound);
    assert_eq!(e.message(), "nothing here");
    server.shutdown().await;
}
