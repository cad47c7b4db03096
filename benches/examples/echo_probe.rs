//! An in-process pipelined 32 B echo (server and client in one process, the soft provider),
//! for counting instructions per call with callgrind: deterministic on a busy host, where
//! timings are not. Not a benchmark (valgrind serializes the threads): compare builds by the
//! shard thread's instructions, or by a function's inclusive count, divided by the calls.
//!
//! ```text
//! cargo build --release -p rpc-bench --example echo_probe
//! valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file=cg \
//!     target/release/examples/echo_probe 20000 32
//! callgrind_annotate cg-01 | head    # the client's thread; the shard's is the file whose
//!                                    # listing has `Shard<P>>::run` (cg-03 or cg-05)
//! ```
//!
//! It makes `calls` echoes (plus 2000 first, not counted by the caller but by callgrind)
//! with `outstanding` in flight through one `Channel::pipeline` on a caller-polled channel.

use std::time::Duration;

use rpc_bench::proto::bench_client::{BenchClient, BenchPipelineClient};
use rpc_bench::proto::{EchoReply, EchoRequest};
use rpc_core::{Channel, ClientPoller, Pipeline, Request};

/// Makes `n` echoes with `k` in flight; returns how many came back.
#[inline(never)]
fn echoes(p: &mut Pipeline<EchoRequest, EchoReply>, n: u64, k: usize) -> u64 {
    let payload = bytes::Bytes::from(vec![7u8; 32]);
    let (mut sent, mut done) = (0, 0);
    loop {
        while sent < n && p.in_flight() < k {
            let mut r = Request::new(EchoRequest {
                payload: payload.clone(),
                reply_size: 0,
            });
            r.set_timeout(Duration::from_secs(10));
            p.submit(sent, r).expect("submit");
            sent += 1;
        }
        let Some((_, r)) = p.wait() else { break };
        assert_eq!(r.expect("echo").get_ref().payload.len(), 32);
        done += 1;
    }
    done
}

fn main() {
    let mut args = std::env::args().skip(1);
    let calls: u64 = args.next().map_or(20_000, |s| s.parse().expect("calls"));
    let outstanding: usize = args.next().map_or(32, |s| s.parse().expect("outstanding"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let service =
        rpc_bench::proto::bench_server::BenchServer::new(rpc_bench::service::BenchService);
    let server = rt
        .block_on(
            rpc_core::Server::builder()
                .add_service(service)
                .shards(1)
                .bind("127.0.0.1:0"),
        )
        .expect("server");
    let channel = rt
        .block_on(
            Channel::builder(server.local_addr().to_string())
                .poller(ClientPoller::Caller)
                .max_concurrent_calls(64)
                .connect(),
        )
        .expect("connect");
    let client = BenchPipelineClient::from(BenchClient::new(channel));
    let mut p = client.echo().expect("pipeline");
    echoes(&mut p, 2000, outstanding);
    let done = echoes(&mut p, calls, outstanding);
    println!("{done} echoes of 32 B, {outstanding} in flight, in one process");
}
