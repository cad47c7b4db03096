//! First end-to-end check of the runtime with a hand-written service.

use bytes::Bytes;
use rpc_core::server::{Dispatched, IncomingCall, Server, Service};
use rpc_core::verbs::Access;
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
static SUM: MethodDesc = MethodDesc::new("/test.Echo/Sum", CallKind::Unary);
static METHODS: [MethodDesc; 3] = [ECHO, FAIL, SUM];

/// A bulk handle: the client's region, read and then overwritten one-sided by the handler.
#[derive(Clone, PartialEq, prost::Message)]
struct Handle {
    #[prost(fixed64, tag = "1")]
    addr: u64,
    #[prost(fixed64, tag = "2")]
    len: u64,
    #[prost(fixed32, tag = "3")]
    rkey: u32,
}

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
        } else if method == SUM.id {
            call.unary(|req: Request<Handle>| async move {
                let peer = req
                    .peer()
                    .cloned()
                    .ok_or_else(|| Status::internal("no peer"))?;
                let h = req.into_inner();
                let remote = rpc_core::verbs::RemoteMr {
                    addr: h.addr,
                    len: h.len,
                    rkey: h.rkey,
                };
                let data = peer.read(remote).await?;
                let sum: u64 = data.iter().map(|&b| u64::from(b)).sum();
                let mut out = peer.buffer(data.len())?;
                for (i, b) in out.iter_mut().enumerate() {
                    *b = (i % 251) as u8;
                }
                peer.write(out, remote).await?;
                Ok(Response::new(Echo {
                    seq: sum,
                    data: Bytes::new(),
                }))
            })
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
    let server = Server::builder()
        .add_service(EchoSvc)
        .bind("127.0.0.1:0")
        .await
        .unwrap();
    let ch = Channel::connect(server.local_addr().to_string())
        .await
        .unwrap();
    for (i, size) in [0usize, 10, 1000, 7000, 9000, 100_000, 5 << 20]
        .into_iter()
        .enumerate()
    {
        let msg = Echo {
            seq: i as u64,
            data: Bytes::from(vec![i as u8; size]),
        };
        let r: Response<Echo> = tokio::time::timeout(
            std::time::Duration::from_secs(10),
            ch.unary(&ECHO, Request::new(msg.clone())),
        )
        .await
        .expect("no hang")
        .unwrap();
        assert_eq!(r.into_inner(), msg, "size {size}");
    }
    let e = ch
        .unary::<_, Echo>(&FAIL, Request::new(Echo::default()))
        .await
        .unwrap_err();
    assert_eq!(e.code(), rpc_core::Code::NotFound);
    assert_eq!(e.message(), "nothing here");

    // Explicit bulk handle: the handler reads the region, then overwrites it.
    let n = 3 << 20;
    let mut region = ch.alloc_region(n).await.unwrap();
    region.fill(3);
    {
        let lease = region
            .lend(Access::REMOTE_READ | Access::REMOTE_WRITE)
            .unwrap();
        let r = lease.remote();
        let h = Handle {
            addr: r.addr,
            len: r.len,
            rkey: r.rkey,
        };
        let sum: Response<Echo> = ch.unary(&SUM, Request::new(h)).await.unwrap();
        assert_eq!(sum.into_inner().seq, 3 * n as u64);
    }
    // The lease is over: the bytes are ours again.
    let bytes = &region[..];
    assert!(bytes.iter().enumerate().all(|(i, &b)| b == (i % 251) as u8));
    server.shutdown().await;
}
