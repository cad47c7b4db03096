//! The greeter server as its own process; stop it with Ctrl-C.
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin greeter_server -- --addr 127.0.0.1:50051
//! cargo run --release -p rpc-examples --bin greeter_client -- --addr 127.0.0.1:50051 --name Ada
//! ```

use clap::Parser;
use rpc_core::server::Server;
use rpc_examples::Greeter;
use rpc_examples::helloworld::greeter_server::GreeterServer;

/// Serves helloworld.Greeter.
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50051")]
    addr: String,
    /// Number of shards (polling threads).
    #[arg(long, default_value_t = 1)]
    shards: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let greeter = std::sync::Arc::new(Greeter::default());
    let server = Server::builder()
        .shards(args.shards)
        .add_service(GreeterServer::from_arc(greeter.clone()))
        .bind(&args.addr)
        .await?;
    println!(
        "greeter_server: listening on {} ({} shard(s)); Ctrl-C to stop",
        server.local_addr(),
        args.shards
    );
    tokio::signal::ctrl_c().await?;
    println!("greeter_server: stopping after {} call(s)", greeter.calls());
    server.shutdown().await;
    Ok(())
}
