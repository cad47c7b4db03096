//! Scratch latency probe (not the benchmark): 32 B unary calls, blocking, caller-polled.
use bytes::Bytes;
use rpc_core::client::PollerMode;
use rpc_core::server::{Dispatched, IncomingCall, PollMode, Server, Service};
use rpc_core::{CallKind, Channel, MethodDesc, Request, Response};
use std::time::Instant;

#[derive(Clone, PartialEq, prost::Message)]
struct Echo {
    #[prost(bytes = "bytes", tag = "1")]
    data: Bytes,
}
static ECHO: MethodDesc = MethodDesc::new("/b.E/Echo", CallKind::Unary);
struct S;
impl Service for S {
    fn name(&self) -> &'static str {
        "b.E"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        std::slice::from_ref(&ECHO)
    }
    fn call(&self, _m: u32, call: IncomingCall<'_>) -> Dispatched {
        call.unary(|r: Request<Echo>| async move { Ok(Response::new(r.into_inner())) })
    }
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (server, ch) = rt.block_on(async {
        let s = Server::builder()
            .add_service(S)
            .poll_mode(PollMode::Busy)
            .bind("127.0.0.1:0")
            .await
            .unwrap();
        let ch = Channel::builder(s.local_addr().to_string())
            .poller(PollerMode::Caller)
            .connect()
            .await
            .unwrap();
        (s, ch)
    });
    let msg = Echo {
        data: Bytes::from(vec![7u8; 32]),
    };
    for _ in 0..20000 {
        let _: Response<Echo> = ch.unary_blocking(&ECHO, Request::new(msg.clone())).unwrap();
    }
    let n = 200_000;
    let mut lat = Vec::with_capacity(n);
    let t0 = Instant::now();
    for _ in 0..n {
        let t = Instant::now();
        let _: Response<Echo> = ch.unary_blocking(&ECHO, Request::new(msg.clone())).unwrap();
        lat.push(t.elapsed().as_nanos() as u64);
    }
    let el = t0.elapsed();
    lat.sort_unstable();
    println!(
        "calls/s {:.0}  p50 {} ns  p99 {} ns  p99.9 {} ns",
        n as f64 / el.as_secs_f64(),
        lat[n / 2],
        lat[n * 99 / 100],
        lat[n * 999 / 1000]
    );
    drop(ch);
    rt.block_on(server.shutdown());
}
