//! Bulk transfer with explicit handles (Mercury-style): the client registers a large buffer
//! once and passes a `BulkHandle` {addr, len, rkey} in a small request; the handler moves the
//! bytes itself with one-sided RDMA READ (`Checksum`) or RDMA WRITE (`Fill`), and only a small
//! reply travels back.
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin bulk -- --size 1GiB
//! ```
//!
//! The client registers its buffer with `Channel::alloc_region` and lends it per call
//! (`Region::lend`: a key for exactly the right the handler needs, revoked when the lease is
//! dropped); the handler reaches it through `Request::peer()` (`Peer::read`, `Peer::buffer` +
//! `Peer::write`) while its call runs. No `unsafe` anywhere.

use std::time::{Duration, Instant};

use clap::Parser;
use rpc_core::server::Server;
use rpc_core::verbs::{Access, RemoteMr};
use rpc_core::{Request, Response, Status};
use rpc_examples::bulk::bulk_client::BulkClient;
use rpc_examples::bulk::bulk_server::{self, BulkServer};
use rpc_examples::bulk::{BulkHandle, Digest, FillReply, FillRequest};
use rpc_examples::{checksum, fill_pattern, human, parse_size};

/// Largest region the server agrees to touch.
const MAX_REGION: u64 = 16 << 30;

/// Serves bulk.Bulk.
#[derive(Debug, Default)]
struct BulkService;

/// Checks a handle a peer sent before anything is posted for it.
fn check(handle: Option<&BulkHandle>) -> Result<&BulkHandle, Status> {
    let h = handle.ok_or_else(|| Status::invalid_argument("missing bulk handle"))?;
    if h.len == 0 || h.len > MAX_REGION {
        return Err(Status::invalid_argument(format!(
            "bulk handle length {} outside 1..={MAX_REGION}",
            h.len
        )));
    }
    if h.addr.checked_add(h.len).is_none() {
        return Err(Status::invalid_argument(
            "bulk handle wraps the address space",
        ));
    }
    Ok(h)
}

impl bulk_server::Bulk for BulkService {
    async fn checksum(&self, request: Request<BulkHandle>) -> Result<Response<Digest>, Status> {
        let peer = request
            .peer()
            .cloned()
            .ok_or_else(|| Status::internal("no peer"))?;
        let h = check(Some(request.get_ref()))?;
        let remote = RemoteMr {
            addr: h.addr,
            len: h.len,
            rkey: h.rkey,
        };
        let t = Instant::now();
        let data = peer.read(remote).await?;
        let read_ns = t.elapsed().as_nanos() as u64;
        Ok(Response::new(Digest {
            checksum: checksum(&data),
            len: data.len() as u64,
            read_ns,
        }))
    }

    async fn fill(&self, request: Request<FillRequest>) -> Result<Response<FillReply>, Status> {
        let peer = request
            .peer()
            .cloned()
            .ok_or_else(|| Status::internal("no peer"))?;
        let r = request.get_ref();
        let h = check(r.handle.as_ref())?;
        let remote = RemoteMr {
            addr: h.addr,
            len: h.len,
            rkey: h.rkey,
        };
        let len = usize::try_from(h.len).map_err(|_| Status::invalid_argument("too large"))?;
        let mut local = peer.buffer(len)?;
        fill_pattern(&mut local, r.seed);
        let t = Instant::now();
        peer.write(local, remote).await?;
        let write_ns = t.elapsed().as_nanos() as u64;
        Ok(Response::new(FillReply {
            len: h.len,
            write_ns,
        }))
    }
}

/// The handle a request carries for a lent range.
fn handle_of(r: RemoteMr) -> BulkHandle {
    BulkHandle {
        addr: r.addr,
        len: r.len,
        rkey: r.rkey,
    }
}

/// Runs the bulk service in-process and moves a large buffer one-sided.
#[derive(Debug, Parser)]
struct Args {
    /// Size of the client's buffer.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    size: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();
    let args = Args::parse();
    let server = Server::builder()
        .add_service(BulkServer::new(BulkService))
        .bind("127.0.0.1:0")
        .await?;
    let addr = server.local_addr();
    println!("bulk: server on {addr}");
    let client = BulkClient::connect(addr.to_string()).await?;

    // Registered memory the server may read or write one-sided, while we lend it.
    let mut region = client.as_ref().alloc_region(args.size).await?;
    fill_pattern(&mut region, 7);
    let expected = checksum(&region);
    println!(
        "bulk: client region {} registered and filled, local checksum {expected:016x}",
        human(region.len() as u64)
    );

    // Lend it for reading: a key for this connection's server, revoked when the lease drops.
    let (d, handle) = {
        let lease = region.lend(Access::REMOTE_READ)?;
        let handle = handle_of(lease.remote());
        (client.checksum(handle).await?.into_inner(), handle)
    };
    anyhow::ensure!(
        d.checksum == expected && d.len == handle.len,
        "the server read different bytes: {:016x} over {} bytes",
        d.checksum,
        d.len
    );
    println!(
        "bulk: server read {} one-sided in {:?} ({:.1} GB/s); checksum matches",
        human(d.len),
        Duration::from_nanos(d.read_ns),
        d.len as f64 / d.read_ns.max(1) as f64
    );

    // The read lease is over: the server can no longer touch the region with that key.
    let fill = {
        let lease = region.lend(Access::REMOTE_WRITE)?;
        let request = FillRequest {
            handle: Some(handle_of(lease.remote())),
            seed: 99,
        };
        client.fill(request).await?.into_inner()
    };
    let mut want = vec![0u8; args.size];
    fill_pattern(&mut want, 99);
    anyhow::ensure!(region[..] == want[..], "the server wrote different bytes");
    println!(
        "bulk: server wrote {} one-sided in {:?} ({:.1} GB/s); contents verified",
        human(fill.len),
        Duration::from_nanos(fill.write_ns),
        fill.len as f64 / fill.write_ns.max(1) as f64
    );
    tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await?;
    Ok(())
}
