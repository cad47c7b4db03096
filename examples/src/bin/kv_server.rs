//! The key-value store as its own process; stop it with Ctrl-C. Values up to `--max-value`
//! (64 MiB by default); above the eager threshold the runtime moves them one-sided (RDMA READ
//! of the request, RDMA WRITE of the reply), not through the send ring.
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin kv_server -- --addr 127.0.0.1:50052
//! ```

use clap::Parser;
use rpc_core::server::Server;
use rpc_examples::kv::kv_server::KvServer;
use rpc_examples::{KvStore, parse_size};

/// Serves kv.Kv from memory.
#[derive(Debug, Parser)]
struct Args {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:50052")]
    addr: String,
    /// Largest value accepted (e.g. 64MiB).
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    max_value: usize,
    /// Number of shards (polling threads).
    #[arg(long, default_value_t = 1)]
    shards: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let server = Server::builder()
        .shards(args.shards)
        .add_service(KvServer::new(KvStore::new(args.max_value)))
        .bind(&args.addr)
        .await?;
    println!(
        "kv_server: listening on {} (values up to {}); Ctrl-C to stop",
        server.local_addr(),
        rpc_examples::human(args.max_value as u64)
    );
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
