//! Explicit regions, lent per call (`Region::lend`): the server reaches the client's memory
//! only through a lease's key, only with the lease's rights and range, only while the lease
//! lives and only while the handler's call runs. Runs on every provider (`RPC_PROVIDER`).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Mutex;

use common::{assert_code, init_logs, within};
use rpc_core::server::{Dispatched, IncomingCall, Peer, Server, Service};
use rpc_core::verbs::{Access, RemoteMr};
use rpc_core::{CallKind, Channel, Code, MethodDesc, Request, Response, Status};
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

static READ: MethodDesc = MethodDesc::new("/test.Regions/Read", CallKind::Unary);
static WRITE: MethodDesc = MethodDesc::new("/test.Regions/Write", CallKind::Unary);
static KEEP: MethodDesc = MethodDesc::new("/test.Regions/Keep", CallKind::Unary);
static LATE: MethodDesc = MethodDesc::new("/test.Regions/Late", CallKind::Unary);
static METHODS: [MethodDesc; 4] = [READ, WRITE, KEEP, LATE];

/// A handle to client memory, and a byte to write.
#[derive(Clone, PartialEq, prost::Message)]
struct Handle {
    #[prost(fixed64, tag = "1")]
    addr: u64,
    #[prost(fixed64, tag = "2")]
    len: u64,
    #[prost(fixed32, tag = "3")]
    rkey: u32,
    #[prost(uint32, tag = "4")]
    fill: u32,
}

impl Handle {
    fn of(r: RemoteMr) -> Handle {
        Handle {
            addr: r.addr,
            len: r.len,
            rkey: r.rkey,
            fill: 0,
        }
    }

    fn remote(&self) -> RemoteMr {
        RemoteMr {
            addr: self.addr,
            len: self.len,
            rkey: self.rkey,
        }
    }
}

/// The sum of the bytes read.
#[derive(Clone, PartialEq, prost::Message)]
struct Sum {
    #[prost(uint64, tag = "1")]
    sum: u64,
}

/// Serializes the tests (they share `KEPT`).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A call the server could not serve by touching our memory: its handler's operation failed
/// with a remote access error, which breaks the connection as RC does, so the call ends
/// `UNAVAILABLE` with the server's reason.
async fn refused(ch: &Channel, m: &'static MethodDesc, h: Handle, what: &str) {
    let r = call(ch, m, h).await;
    assert_code(&r, Code::Unavailable, what);
    let msg = r.unwrap_err().message().to_owned();
    assert!(
        msg.contains("REM_ACCESS_ERR"),
        "{what}: the status names the remote access error: {msg}"
    );
}

/// The `Peer` of a `KEEP` call and its handle, kept past the call's end.
static KEPT: Mutex<Option<(Peer, RemoteMr)>> = Mutex::new(None);

struct Regions;

fn peer_of<T>(req: &Request<T>) -> Result<Peer, Status> {
    req.peer()
        .cloned()
        .ok_or_else(|| Status::internal("no peer"))
}

async fn sum(peer: &Peer, remote: RemoteMr) -> Result<Response<Sum>, Status> {
    let data = peer.read(remote).await?;
    Ok(Response::new(Sum {
        sum: data.iter().map(|&b| u64::from(b)).sum(),
    }))
}

impl Service for Regions {
    fn name(&self) -> &'static str {
        "test.Regions"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
        if method == READ.id {
            call.unary(|req: Request<Handle>| async move {
                let peer = peer_of(&req)?;
                sum(&peer, req.get_ref().remote()).await
            })
        } else if method == WRITE.id {
            call.unary(|req: Request<Handle>| async move {
                let peer = peer_of(&req)?;
                let h = req.into_inner();
                let mut buf = peer.buffer(h.len as usize)?;
                buf.fill(h.fill as u8);
                peer.write(buf, h.remote()).await?;
                Ok(Response::new(Sum::default()))
            })
        } else if method == KEEP.id {
            call.unary(|req: Request<Handle>| async move {
                let peer = peer_of(&req)?;
                *KEPT.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some((peer, req.get_ref().remote()));
                Ok(Response::new(Sum::default()))
            })
        } else if method == LATE.id {
            call.unary(|_req: Request<Handle>| async move {
                let kept = KEPT.lock().unwrap_or_else(|p| p.into_inner()).take();
                let (peer, remote) = kept.ok_or_else(|| Status::internal("nothing kept"))?;
                sum(&peer, remote).await
            })
        } else {
            call.unimplemented()
        }
    }
}

async fn server() -> rpc_core::RunningServer {
    init_logs();
    *KEPT.lock().unwrap_or_else(|p| p.into_inner()) = None;
    Server::builder()
        .add_service(Regions)
        .bind("127.0.0.1:0")
        .await
        .unwrap()
}

async fn connect(server: &rpc_core::RunningServer) -> Channel {
    within(
        LIMIT,
        "connect",
        Channel::connect(server.local_addr().to_string()),
    )
    .await
    .unwrap()
}

async fn call(ch: &Channel, m: &'static MethodDesc, h: Handle) -> Result<Sum, Status> {
    within(LIMIT, m.path, ch.unary::<_, Sum>(m, Request::new(h)))
        .await
        .map(Response::into_inner)
}

const N: usize = 256 << 10;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_lease_gives_the_server_nothing() {
    let _serial = SERIAL.lock().await;
    let server = server().await;
    let (a, b) = (connect(&server).await, connect(&server).await);
    let mut region = a.alloc_region(N).await.unwrap();
    region.fill(2);
    let stale = {
        let lease = region.lend(Access::REMOTE_READ).unwrap();
        let h = Handle::of(lease.remote());
        assert_eq!(call(&a, &READ, h.clone()).await.unwrap().sum, 2 * N as u64);
        h
    };
    // The lease is over: the same key now fails the server's READ...
    refused(&a, &READ, stale.clone(), "READ through a revoked key").await;
    // ...the region is ours, untouched...
    assert!(region.iter().all(|&x| x == 2));
    // ...and another connection is not affected.
    let mut other = b.alloc_region(N).await.unwrap();
    other.fill(1);
    let lease = other.lend(Access::REMOTE_READ).unwrap();
    let h = Handle::of(lease.remote());
    assert_eq!(call(&b, &READ, h).await.unwrap().sum, N as u64);
    drop(lease);
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_grants_its_right_over_its_range_only() {
    let _serial = SERIAL.lock().await;
    let server = server().await;
    let mut region = connect(&server).await.alloc_region(N).await.unwrap();
    for (i, x) in region.iter_mut().enumerate() {
        *x = (i % 7) as u8;
    }
    let (lo, hi) = (4096, 3 * 4096);
    let want: u64 = region[lo..hi].iter().map(|&x| u64::from(x)).sum();
    drop(region);

    // Each refused access breaks its connection: one connection per case.
    let ch = connect(&server).await;
    let mut region = ch.alloc_region(N).await.unwrap();
    region.copy_from_slice(&(0..N).map(|i| (i % 7) as u8).collect::<Vec<_>>());
    let lease = region.lend_range(lo..hi, Access::REMOTE_READ).unwrap();
    let h = Handle::of(lease.remote());
    assert_eq!(h.len, (hi - lo) as u64);
    assert_eq!(call(&ch, &READ, h.clone()).await.unwrap().sum, want);
    // No write right.
    let w = Handle {
        fill: 9,
        ..h.clone()
    };
    refused(&ch, &WRITE, w, "WRITE through a READ lease").await;
    drop(lease);
    assert!(
        region[lo..hi]
            .iter()
            .enumerate()
            .all(|(i, &x)| x == ((lo + i) % 7) as u8)
    );

    // Past the range.
    let ch = connect(&server).await;
    let mut region = ch.alloc_region(N).await.unwrap();
    let lease = region.lend_range(lo..hi, Access::REMOTE_READ).unwrap();
    let h = Handle::of(lease.remote());
    let past = Handle {
        len: h.len + 1,
        ..h.clone()
    };
    refused(&ch, &READ, past, "READ one byte past the lease").await;
    drop(lease);

    // Before the range.
    let ch = connect(&server).await;
    let mut region = ch.alloc_region(N).await.unwrap();
    let lease = region.lend_range(lo..hi, Access::REMOTE_READ).unwrap();
    let h = Handle::of(lease.remote());
    let before = Handle {
        addr: h.addr - 1,
        ..h.clone()
    };
    refused(&ch, &READ, before, "READ one byte before the lease").await;
    drop(lease);

    // Bad arguments are refused locally.
    let ch = connect(&server).await;
    let mut region = ch.alloc_region(N).await.unwrap();
    assert_code(
        &region.lend_range(lo..lo, Access::REMOTE_READ).map(|_| ()),
        Code::InvalidArgument,
        "empty lease",
    );
    assert_code(
        &region
            .lend_range(lo..N + 1, Access::REMOTE_READ)
            .map(|_| ()),
        Code::InvalidArgument,
        "lease past the region",
    );
    assert_code(
        &region.lend(Access::LOCAL_WRITE).map(|_| ()),
        Code::InvalidArgument,
        "a local right",
    );
    // A write lease works as a write lease.
    {
        let lease = region.lend_range(lo..hi, Access::REMOTE_WRITE).unwrap();
        let h = Handle {
            fill: 5,
            ..Handle::of(lease.remote())
        };
        call(&ch, &WRITE, h).await.unwrap();
    }
    assert!(region[..lo].iter().all(|&x| x == 0));
    assert!(region[lo..hi].iter().all(|&x| x == 5));
    assert!(region[hi..].iter().all(|&x| x == 0));
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_reaches_client_memory_only_while_its_call_runs() {
    let _serial = SERIAL.lock().await;
    let server = server().await;
    let ch = connect(&server).await;
    let mut region = ch.alloc_region(N).await.unwrap();
    region.fill(3);
    let lease = region.lend(Access::REMOTE_READ).unwrap();
    let h = Handle::of(lease.remote());
    // The handler keeps its Peer and the handle, and returns.
    call(&ch, &KEEP, h.clone()).await.unwrap();
    // A later call uses them while the client's lease still lives: refused by the server.
    assert_code(
        &call(&ch, &LATE, h.clone()).await,
        Code::FailedPrecondition,
        "a Peer used after its call ended",
    );
    // Nothing broke: the connection and the lease still serve a call that runs.
    assert_eq!(call(&ch, &READ, h).await.unwrap().sum, 3 * N as u64);
    drop(lease);
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaked_lease_is_revoked_before_the_bytes_are_ours_again() {
    let _serial = SERIAL.lock().await;
    let server = server().await;
    let ch = connect(&server).await;
    let mut region = ch.alloc_region(N).await.unwrap();
    region.fill(4);
    let lease = region.lend(Access::REMOTE_WRITE).unwrap();
    let h = Handle {
        fill: 6,
        ..Handle::of(lease.remote())
    };
    std::mem::forget(lease);
    // Touching the bytes revokes the leaked key first...
    assert!(region.iter().all(|&x| x == 4));
    // ...so the server can no longer write them.
    refused(&ch, &WRITE, h, "WRITE through a leaked lease's key").await;
    assert!(region.iter().all(|&x| x == 4));
    within(LIMIT, "shutdown", server.shutdown()).await;
}
