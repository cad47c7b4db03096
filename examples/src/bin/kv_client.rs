//! Command-line client of the key-value store (see `kv_server`).
//!
//! ```sh
//! kv_client put greeting --value hello
//! kv_client put big --size 64MiB            # generated pattern, checksum printed
//! kv_client put file --file ./data.bin
//! kv_client get big                         # size, checksum and throughput
//! kv_client get file --out ./copy.bin
//! kv_client list --prefix b
//! kv_client delete big
//! ```

use std::time::Instant;

use anyhow::Context as _;
use bytes::Bytes;
use clap::{Parser, Subcommand};
use rpc_core::Code;
use rpc_examples::kv::kv_client::KvClient;
use rpc_examples::kv::{DeleteRequest, GetRequest, ListRequest, PutRequest};
use rpc_examples::{checksum, fill_pattern, human, parse_size, rate};

/// kv.Kv client.
#[derive(Debug, Parser)]
struct Args {
    /// Server address.
    #[arg(long, default_value = "127.0.0.1:50052")]
    addr: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Stores a value: given, read from a file, or generated.
    Put {
        key: String,
        /// The value as text.
        #[arg(long, conflicts_with_all = ["file", "size"])]
        value: Option<String>,
        /// Read the value from this file.
        #[arg(long, conflicts_with = "size")]
        file: Option<std::path::PathBuf>,
        /// Generate a value of this size (e.g. 64MiB).
        #[arg(long, value_parser = parse_size)]
        size: Option<usize>,
        /// Seed of the generated pattern.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Reads a value.
    Get {
        key: String,
        /// Write the value to this file instead of describing it.
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Removes a key.
    Delete { key: String },
    /// Lists keys with their sizes.
    List {
        /// Only keys with this prefix.
        #[arg(long, default_value = "")]
        prefix: String,
        /// Start after this key.
        #[arg(long, default_value = "")]
        start_after: String,
        /// At most this many keys (0: the server's default).
        #[arg(long, default_value_t = 0)]
        limit: u32,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let client = KvClient::connect(&args.addr)
        .await
        .with_context(|| format!("connecting to {}", args.addr))?;
    match args.command {
        Command::Put {
            key,
            value,
            file,
            size,
            seed,
        } => {
            let value: Bytes = match (value, file, size) {
                (Some(v), _, _) => v.into(),
                (_, Some(path), _) => std::fs::read(&path)
                    .with_context(|| format!("reading {}", path.display()))?
                    .into(),
                (_, _, Some(n)) => {
                    let mut v = vec![0u8; n];
                    fill_pattern(&mut v, seed);
                    v.into()
                }
                _ => anyhow::bail!("put needs --value, --file or --size"),
            };
            let len = value.len() as u64;
            let sum = checksum(&value);
            let t = Instant::now();
            let reply = client
                .put(PutRequest {
                    key: key.clone(),
                    value,
                })
                .await?;
            let elapsed = t.elapsed();
            println!(
                "put {key:?}: {} (checksum {sum:016x}) in {elapsed:?}, {}{}",
                human(len),
                rate(len, elapsed),
                if reply.get_ref().replaced {
                    ", replaced"
                } else {
                    ""
                }
            );
        }
        Command::Get { key, out } => {
            let t = Instant::now();
            let reply = match client.get(GetRequest { key: key.clone() }).await {
                Ok(r) => r.into_inner(),
                Err(s) if s.code() == Code::NotFound => {
                    println!("get {key:?}: not found");
                    std::process::exit(1);
                }
                Err(s) => return Err(s.into()),
            };
            let elapsed = t.elapsed();
            let len = reply.value.len() as u64;
            match out {
                Some(path) => {
                    std::fs::write(&path, &reply.value)
                        .with_context(|| format!("writing {}", path.display()))?;
                    println!(
                        "get {key:?}: {} written to {} in {elapsed:?}, {}",
                        human(len),
                        path.display(),
                        rate(len, elapsed)
                    );
                }
                None if len <= 64 && std::str::from_utf8(&reply.value).is_ok() => {
                    println!("get {key:?}: {:?}", String::from_utf8_lossy(&reply.value));
                }
                None => println!(
                    "get {key:?}: {} (checksum {:016x}) in {elapsed:?}, {}",
                    human(len),
                    checksum(&reply.value),
                    rate(len, elapsed)
                ),
            }
        }
        Command::Delete { key } => {
            let reply = client.delete(DeleteRequest { key: key.clone() }).await?;
            println!(
                "delete {key:?}: {}",
                if reply.get_ref().existed {
                    "deleted"
                } else {
                    "was not there"
                }
            );
        }
        Command::List {
            prefix,
            start_after,
            limit,
        } => {
            let reply = client
                .list(ListRequest {
                    prefix,
                    start_after,
                    limit,
                })
                .await?
                .into_inner();
            for e in &reply.entries {
                println!("{:>12}  {}", human(e.size), e.key);
            }
            if reply.truncated {
                let last = reply.entries.last().map_or("", |e| e.key.as_str());
                println!("... more after {last:?} (use --start-after)");
            }
        }
    }
    Ok(())
}
