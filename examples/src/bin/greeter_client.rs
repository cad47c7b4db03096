//! Calls a running greeter server (see `greeter_server`).
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin greeter_client -- --addr 127.0.0.1:50051 --name Ada --count 10000
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use rpc_core::Request;
use rpc_examples::helloworld::HelloRequest;
use rpc_examples::helloworld::greeter_client::{GreeterBlockingClient, GreeterClient};

/// Calls helloworld.Greeter/SayHello.
#[derive(Debug, Parser)]
struct Args {
    /// Server address.
    #[arg(long, default_value = "127.0.0.1:50051")]
    addr: String,
    /// Name to greet.
    #[arg(long, default_value = "world")]
    name: String,
    /// Number of calls; above 1, latency percentiles are printed.
    #[arg(long, default_value_t = 1)]
    count: u64,
    /// Use the blocking client (the calling thread polls the completion queue).
    #[arg(long)]
    blocking: bool,
    /// Per-call timeout in milliseconds.
    #[arg(long, default_value_t = 5000)]
    timeout_ms: u64,
}

fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let client = runtime.block_on(GreeterClient::connect(&args.addr))?;
    let blocking = GreeterBlockingClient::from(client.clone());
    let request = || {
        let mut r = Request::new(HelloRequest {
            name: args.name.clone(),
        });
        r.set_timeout(Duration::from_millis(args.timeout_ms));
        r
    };

    let mut hist = hdrhistogram::Histogram::<u64>::new(3)?;
    let mut last = String::new();
    let start = Instant::now();
    for _ in 0..args.count {
        let t = Instant::now();
        let reply = if args.blocking {
            blocking.say_hello(request())?
        } else {
            runtime.block_on(client.say_hello(request()))?
        };
        hist.record(t.elapsed().as_nanos() as u64)?;
        last = reply.into_inner().message;
    }
    let elapsed = start.elapsed();
    println!("greeter_client: {last:?}");
    if args.count > 1 {
        let us = |q: f64| hist.value_at_quantile(q) as f64 / 1000.0;
        println!(
            "greeter_client: {} {} calls in {elapsed:?}: p50 {:.1} us, p99 {:.1} us, p99.9 {:.1} us, {:.0} calls/s",
            args.count,
            if args.blocking { "blocking" } else { "async" },
            us(0.5),
            us(0.99),
            us(0.999),
            args.count as f64 / elapsed.as_secs_f64()
        );
    }
    Ok(())
}
