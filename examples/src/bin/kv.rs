//! The key-value store in one command: serves it in-process, then puts, lists, gets (a 64 MiB
//! value included, checked end to end) and deletes.
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin kv -- --size 64MiB
//! ```

use std::time::{Duration, Instant};

use bytes::Bytes;
use clap::Parser;
use rpc_core::Code;
use rpc_core::server::Server;
use rpc_examples::kv::kv_client::KvClient;
use rpc_examples::kv::kv_server::KvServer;
use rpc_examples::kv::{DeleteRequest, GetRequest, ListRequest, PutRequest};
use rpc_examples::{KvStore, checksum, fill_pattern, human, parse_size, rate};

/// Serves kv.Kv in-process and exercises it.
#[derive(Debug, Parser)]
struct Args {
    /// Size of the large value.
    #[arg(long, default_value = "64MiB", value_parser = parse_size)]
    size: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let server = Server::builder()
        .add_service(KvServer::new(KvStore::new(args.size.max(1 << 20))))
        .bind("127.0.0.1:0")
        .await?;
    let addr = server.local_addr();
    println!("kv: server on {addr}");
    let client = KvClient::connect(addr.to_string()).await?;

    for (key, value) in [("color", "blue"), ("shape", "round"), ("size", "large")] {
        client
            .put(PutRequest {
                key: key.into(),
                value: Bytes::from_static(value.as_bytes()),
            })
            .await?;
    }
    println!("kv: put 3 small values");

    let mut big = vec![0u8; args.size];
    fill_pattern(&mut big, 42);
    let sum = checksum(&big);
    let big = Bytes::from(big);
    let t = Instant::now();
    client
        .put(PutRequest {
            key: "big".into(),
            value: big.clone(),
        })
        .await?;
    let put = t.elapsed();
    println!(
        "kv: put \"big\": {} in {put:?} ({})",
        human(big.len() as u64),
        rate(big.len() as u64, put)
    );

    let listed = client.list(ListRequest::default()).await?.into_inner();
    for e in &listed.entries {
        println!("kv: list: {:>10}  {}", human(e.size), e.key);
    }

    let t = Instant::now();
    let got = client
        .get(GetRequest { key: "big".into() })
        .await?
        .into_inner();
    let get = t.elapsed();
    anyhow::ensure!(
        got.value.len() == big.len() && checksum(&got.value) == sum,
        "the value read back differs from the value written"
    );
    println!(
        "kv: get \"big\": {} in {get:?} ({}), checksum {sum:016x} matches",
        human(got.value.len() as u64),
        rate(got.value.len() as u64, get)
    );

    let small = client
        .get(GetRequest {
            key: "color".into(),
        })
        .await?;
    println!(
        "kv: get \"color\": {:?}",
        String::from_utf8_lossy(&small.get_ref().value)
    );

    client.delete(DeleteRequest { key: "big".into() }).await?;
    let gone = client
        .get(GetRequest { key: "big".into() })
        .await
        .expect_err("deleted");
    anyhow::ensure!(gone.code() == Code::NotFound, "unexpected status {gone}");
    println!("kv: delete \"big\", then get -> {}", gone.code());

    tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await?;
    Ok(())
}
