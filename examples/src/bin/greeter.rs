//! The first command: serves the greeter in-process on 127.0.0.1 (any free port) and calls it,
//! asynchronously and blocking, on the default provider (the soft RNIC: no hardware, no root).
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin greeter
//! ```

use std::time::{Duration, Instant};

use rpc_core::server::Server;
use rpc_examples::Greeter;
use rpc_examples::helloworld::HelloRequest;
use rpc_examples::helloworld::greeter_client::{GreeterBlockingClient, GreeterClient};
use rpc_examples::helloworld::greeter_server::GreeterServer;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();

    let server = Server::builder()
        .add_service(GreeterServer::new(Greeter::default()))
        .bind("127.0.0.1:0")
        .await?;
    let addr = server.local_addr();
    println!("server: helloworld.Greeter listening on {addr}");

    let client = GreeterClient::connect(addr.to_string()).await?;
    println!("client: connected to {addr}");

    let reply = client
        .say_hello(HelloRequest {
            name: "world".into(),
        })
        .await?;
    println!(
        "client: say_hello(\"world\") -> {:?}",
        reply.get_ref().message
    );

    // A handler's error comes back as the call's status.
    let status = client
        .say_hello(HelloRequest::default())
        .await
        .expect_err("an empty name is refused");
    println!("client: say_hello(\"\") -> {}", status);

    // The blocking client: the calling thread polls the completion queue itself.
    let blocking = GreeterBlockingClient::from(client.clone());
    let reply = tokio::task::spawn_blocking(move || {
        blocking.say_hello(HelloRequest {
            name: "blocking world".into(),
        })
    })
    .await??;
    println!(
        "client: blocking say_hello(\"blocking world\") -> {:?}",
        reply.get_ref().message
    );

    // A quick latency figure (not a benchmark: see benches/ for that): async calls as above,
    // then blocking calls from one thread, on the same channel, after as many untimed calls
    // (the first calls of a connection fault in its pages and warm its caches).
    const CALLS: usize = 2000;
    for i in 0..CALLS {
        client
            .say_hello(HelloRequest {
                name: format!("#{i}"),
            })
            .await?;
    }
    let mut samples = Vec::with_capacity(CALLS);
    for i in 0..CALLS {
        let t = Instant::now();
        client
            .say_hello(HelloRequest {
                name: format!("#{i}"),
            })
            .await?;
        samples.push(t.elapsed());
    }
    let blocking = GreeterBlockingClient::from(client.clone());
    let blocking_samples = tokio::task::spawn_blocking(move || {
        let mut samples = Vec::with_capacity(CALLS);
        for i in 0..CALLS {
            let t = Instant::now();
            blocking.say_hello(HelloRequest {
                name: format!("#{i}"),
            })?;
            samples.push(t.elapsed());
        }
        Ok::<_, rpc_core::Status>(samples)
    })
    .await??;
    for (what, mut samples) in [("async", samples), ("blocking", blocking_samples)] {
        samples.sort();
        let p = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
        println!(
            "client: {CALLS} {what} calls, p50 {:?}, p99 {:?}",
            p(0.50),
            p(0.99)
        );
    }

    tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await?;
    println!("server: shut down");
    Ok(())
}
