//! Bulk transfer with explicit handles (Mercury-style): the client registers a large buffer
//! once and passes a `BulkHandle` {addr, len, rkey} in a small request; the handler moves the
//! bytes itself with one-sided RDMA READ (`Checksum`) or RDMA WRITE (`Fill`), and only a small
//! reply travels back.
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin bulk -- --size 1GiB
//! ```
//!
//! STATUS: the runtime contract has no API yet for registering user memory on a channel nor
//! for one-sided operations from a handler. The places that need them are marked
//! `TODO-runtime` with the calls this example expects; until they exist the handler answers
//! `UNIMPLEMENTED` and the client says so and exits with status 2. Everything else (service,
//! handles, checks, verification) is real.

use std::time::Duration;

use clap::Parser;
use rpc_core::server::Server;
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
        let handle = check(Some(request.get_ref()))?;
        // TODO-runtime: one-sided READ of the caller's region from the handler, e.g.
        //     let bulk = request.bulk()?;                  // the call's connection
        //     let mut local = bulk.buffer(handle.len)?;    // registered memory (BulkPool)
        //     let t = Instant::now();
        //     bulk.read(RemoteMr { addr: handle.addr, len: handle.len, rkey: handle.rkey },
        //               &mut local).await?;            // RDMA READ; REM_ACCESS_ERR -> Status
        //     return Ok(Response::new(Digest { checksum: checksum(&local), len: handle.len,
        //                                      read_ns: t.elapsed().as_nanos() as u64 }));
        let _ = (checksum as fn(&[u8]) -> u64, handle);
        Err(Status::unimplemented(
            "bulk.Bulk/Checksum: one-sided RDMA READ from a handler is not in the runtime \
             contract yet (TODO-runtime)",
        ))
    }

    async fn fill(&self, request: Request<FillRequest>) -> Result<Response<FillReply>, Status> {
        let r = request.get_ref();
        let handle = check(r.handle.as_ref())?;
        // TODO-runtime: fill a registered local buffer with `fill_pattern(&mut local, r.seed)`,
        // then `bulk.write(&local, RemoteMr { .. }).await?` (RDMA WRITE), as in `checksum`.
        let _ = (fill_pattern as fn(&mut [u8], u64), handle);
        Err(Status::unimplemented(
            "bulk.Bulk/Fill: one-sided RDMA WRITE from a handler is not in the runtime \
             contract yet (TODO-runtime)",
        ))
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

    let mut buf = vec![0u8; args.size];
    fill_pattern(&mut buf, 7);
    let expected = checksum(&buf);
    println!(
        "bulk: client buffer {} filled, local checksum {expected:016x}",
        human(buf.len() as u64)
    );

    // TODO-runtime: register the buffer for remote READ and WRITE on this channel, e.g.
    //     let region = client.channel().register(&mut buf, Access::REMOTE_READ | Access::REMOTE_WRITE)?;
    //     let mr = region.remote();                     // RemoteMr { addr, len, rkey }
    // The handle then carries the region's real address, length and rkey:
    let handle = BulkHandle {
        addr: buf.as_ptr() as u64,
        len: buf.len() as u64,
        rkey: 0, // TODO-runtime: region.remote().rkey
    };

    match client.checksum(handle).await {
        Ok(digest) => {
            let d = digest.into_inner();
            anyhow::ensure!(
                d.checksum == expected && d.len == buf.len() as u64,
                "the server read different bytes: {:016x} over {} bytes",
                d.checksum,
                d.len
            );
            println!(
                "bulk: server read {} one-sided in {:?}; checksum matches",
                human(d.len),
                Duration::from_nanos(d.read_ns)
            );
            let fill = client
                .fill(FillRequest {
                    handle: Some(handle),
                    seed: 99,
                })
                .await?
                .into_inner();
            let mut want = vec![0u8; buf.len()];
            fill_pattern(&mut want, 99);
            anyhow::ensure!(buf == want, "the server wrote different bytes");
            println!(
                "bulk: server wrote {} one-sided in {:?}; contents verified",
                human(fill.len),
                Duration::from_nanos(fill.write_ns)
            );
        }
        Err(status) if status.code() == rpc_core::Code::Unimplemented => {
            println!("bulk: not available yet: {}", status.message());
            tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await?;
            std::process::exit(2);
        }
        Err(status) => return Err(status.into()),
    }
    tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await?;
    Ok(())
}
