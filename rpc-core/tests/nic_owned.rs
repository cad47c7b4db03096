//! Buffers owned by the NIC while posted (issue 13, item 4): a flushed READ is a failure, never
//! decoded; closing a connection, a failed link and a server shutdown release nothing that a
//! posted work request names before the QP is destroyed.
//!
//! The soft provider's one-sided fault hook (`verbs::soft::fault::arm_one_sided`) flushes or
//! holds (delays) the next READ/WRITE/bulk operation the RPC layer posts; the link's
//! process-wide `parked_stats` count the buffers kept until their QPs were destroyed. Both are
//! process-wide, so the tests of this file run one at a time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::{Blob, GenRequest, TestServer, lab_server, pattern, wait_until, within};
use rpc_core::server::{Dispatched, IncomingCall, Server, Service};
use rpc_core::testing::{ParkedStats, parked_stats};
use rpc_core::verbs::soft::fault::{OneSided, OneSidedFault, arm_one_sided, one_sided_left};
use rpc_core::verbs::{Access, RemoteMr};
use rpc_core::{CallKind, Channel, ClientPoller, Code, MethodDesc, Request, Response, Status};

/// One test at a time: the fault hook and the counters are process-wide.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long a held operation stays posted: far longer than any test.
const HOLD: Duration = Duration::from_secs(600);
const LIMIT: Duration = Duration::from_secs(30);

fn disarm() {
    arm_one_sided(OneSided::ClientRead, OneSidedFault::Flush, 0);
}

/// Buffers parked and freed since `before`.
fn delta(before: ParkedStats) -> (u64, u64) {
    let now = parked_stats();
    (
        now.parked.saturating_sub(before.parked),
        now.buried.saturating_sub(before.buried),
    )
}

/// The counters once every earlier test's connections are gone (their parked buffers freed).
async fn quiet() -> ParkedStats {
    wait_until(LIMIT, "earlier connections gone", || {
        let s = parked_stats();
        s.parked == s.buried
    })
    .await;
    parked_stats()
}

// ----- a flushed READ ------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flushed_rendezvous_read_fails_the_call_and_is_never_decoded() {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start().await;
    let len = 1 << 20;
    // Every response READ: a channel lends landing zones by itself after a large response.
    let connect = async |mode: ClientPoller| {
        within(
            LIMIT,
            "connect",
            server
                .builder()
                .poller(mode)
                .learn_response_sizes(false)
                .connect(),
        )
        .await
        .expect("channel connects")
    };
    for mode in [ClientPoller::Thread, ClientPoller::Caller] {
        let ch = connect(mode).await;
        // The same size first: the pool hands its buffer to the next READ, so a flushed READ
        // that was decoded would return this response again.
        let req = Request::new(GenRequest { seq: 1, len });
        let r: Response<Blob> = within(LIMIT, "warm-up", ch.unary(&lab_server::GENERATE, req))
            .await
            .unwrap();
        assert_eq!(r.get_ref().data, pattern(len as usize, 1));
        drop(r);

        arm_one_sided(OneSided::ClientRead, OneSidedFault::Flush, 1);
        let req = Request::new(GenRequest { seq: 2, len });
        let r: Result<Response<Blob>, Status> =
            within(LIMIT, "flushed call", ch.unary(&lab_server::GENERATE, req)).await;
        assert_eq!(one_sided_left(), 0, "{mode:?}: the READ was not posted");
        disarm();
        let st = match r {
            Ok(resp) => panic!(
                "{mode:?}: a flushed READ was decoded: seq {} with {} bytes",
                resp.get_ref().seq,
                resp.get_ref().data.len()
            ),
            Err(st) => st,
        };
        assert_eq!(st.code(), Code::Unavailable, "{mode:?}: {st:?}");
        for word in ["RDMA READ", "flushed", "WR_FLUSH_ERR"] {
            assert!(
                st.message().contains(word),
                "{mode:?}: the status names the cause ({word}): {st:?}"
            );
        }
        drop(ch);
        // The server is unharmed: a new connection works.
        let ch = connect(mode).await;
        let req = Request::new(GenRequest { seq: 3, len });
        let r: Response<Blob> = within(LIMIT, "after", ch.unary(&lab_server::GENERATE, req))
            .await
            .unwrap();
        assert_eq!(r.get_ref().data, pattern(len as usize, 3));
    }
    server.server.shutdown().await;
}

// ----- a failed link on the client -----------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_link_keeps_the_clients_read_target_until_its_qp_is_destroyed() {
    let _serial = SERIAL.lock().await;
    let server = TestServer::start_with(|b| b.shutdown_grace(Duration::from_millis(100))).await;
    let ch = server.channel(ClientPoller::Thread).await;
    let before = quiet().await;
    // The response's READ stays posted (in the NIC's hands) while the server goes away.
    arm_one_sided(OneSided::ClientRead, OneSidedFault::Delay(HOLD), 1);
    let call = {
        let ch = ch.clone();
        tokio::spawn(async move {
            let req = Request::new(GenRequest {
                seq: 9,
                len: 1 << 20,
            });
            ch.unary::<_, Blob>(&lab_server::GENERATE, req).await
        })
    };
    wait_until(LIMIT, "READ posted", || one_sided_left() == 0).await;
    disarm();
    within(LIMIT, "shutdown", server.server.shutdown()).await;
    let r = within(LIMIT, "call", call).await.unwrap();
    let st = r.expect_err("the call cannot succeed: its READ never ran");
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    // The server parked the response it lent (its QP is gone: buried); the client parked the
    // READ target and, its QP still existing, must not have freed it.
    wait_until(LIMIT, "client parks", || {
        let (p, b) = delta(before);
        p >= 2 && p > b
    })
    .await;
    let (p, b) = delta(before);
    assert!(
        p - b >= 1,
        "the READ target was freed while its QP exists: {p} parked, {b} freed"
    );
    // Dropping the channel destroys the client's QP, then frees what it parked.
    drop(ch);
    wait_until(LIMIT, "client buries", || {
        let (p, b) = delta(before);
        p == b
    })
    .await;
}

// ----- closing a connection and shutting down with bulk operations in flight -----------------

static ECHO: MethodDesc = MethodDesc::new("/nic.Owned/Echo", CallKind::Unary);
static BULK: MethodDesc = MethodDesc::new("/nic.Owned/Bulk", CallKind::Unary);
static METHODS: [MethodDesc; 2] = [ECHO, BULK];

/// A client region for the handler to READ (`write == false`) or overwrite with `fill`.
#[derive(Clone, PartialEq, prost::Message)]
struct Handle {
    #[prost(fixed64, tag = "1")]
    addr: u64,
    #[prost(fixed64, tag = "2")]
    len: u64,
    #[prost(fixed32, tag = "3")]
    rkey: u32,
    #[prost(bool, tag = "4")]
    write: bool,
    #[prost(uint32, tag = "5")]
    fill: u32,
}

#[derive(Clone, PartialEq, prost::Message)]
struct Echo {
    #[prost(bytes = "bytes", tag = "1")]
    data: Bytes,
}

struct OwnedSvc;

impl Service for OwnedSvc {
    fn name(&self) -> &'static str {
        "nic.Owned"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, method: u32, call: IncomingCall<'_>) -> Dispatched {
        if method == ECHO.id {
            call.unary(|req: Request<Echo>| async move { Ok(Response::new(req.into_inner())) })
        } else if method == BULK.id {
            call.unary(|req: Request<Handle>| async move {
                let peer = req
                    .peer()
                    .cloned()
                    .ok_or_else(|| Status::internal("no peer"))?;
                let h = req.into_inner();
                let remote = rpc_core::verbs::RemoteMr {
                    addr: h.addr,
                    len: h.len,
                    rkey: h.rkey,
                };
                if h.write {
                    let mut out = peer.buffer(h.len as usize)?;
                    out.fill(h.fill as u8);
                    peer.write(out, remote).await?;
                } else {
                    peer.read(remote).await?;
                }
                Ok(Response::new(Echo::default()))
            })
        } else {
            call.unimplemented()
        }
    }
}

async fn owned_server() -> rpc_core::RunningServer {
    common::init_logs();
    within(
        LIMIT,
        "bind",
        Server::builder()
            .add_service(OwnedSvc)
            .shutdown_grace(Duration::from_millis(100))
            .bind(common::LOCALHOST),
    )
    .await
    .unwrap()
}

/// Starts a BULK call on `ch` over `region` whose one-sided operation the server holds posted.
async fn held_bulk_call(
    ch: &Channel,
    r: RemoteMr,
    write: bool,
) -> tokio::task::JoinHandle<Result<Response<Echo>, Status>> {
    let h = Handle {
        addr: r.addr,
        len: r.len,
        rkey: r.rkey,
        write,
        fill: 0xab,
    };
    arm_one_sided(OneSided::HandlerBulk, OneSidedFault::Delay(HOLD), 1);
    let ch = ch.clone();
    let call = tokio::spawn(async move { ch.unary::<_, Echo>(&BULK, Request::new(h)).await });
    wait_until(LIMIT, "bulk operation posted", || one_sided_left() == 0).await;
    disarm();
    call
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_connection_with_a_bulk_operation_in_flight_frees_nothing_before_the_qp() {
    let _serial = SERIAL.lock().await;
    let server = owned_server().await;
    let addr = server.local_addr().to_string();
    let ch = within(LIMIT, "connect", Channel::connect(addr.clone()))
        .await
        .unwrap();
    let mut region = ch.alloc_region(1 << 20).await.unwrap();
    let lease = region.lend(Access::REMOTE_READ).unwrap();
    let before = quiet().await;
    let call = held_bulk_call(&ch, lease.remote(), false).await;
    // The handler's READ of the region is posted and held. The client goes away.
    call.abort();
    drop(lease);
    drop(region);
    drop(ch);
    // The server's close parks the operation's buffer, destroys the QP, then frees it.
    wait_until(LIMIT, "close parks and frees the bulk buffer", || {
        let (p, b) = delta(before);
        p >= 1 && p == b
    })
    .await;
    wait_until(LIMIT, "call retired", || server.live_calls() == 0).await;
    // The shard is fine: a new connection's bulk calls work.
    let ch = within(LIMIT, "reconnect", Channel::connect(addr))
        .await
        .unwrap();
    let mut region = ch.alloc_region(64 << 10).await.unwrap();
    {
        let lease = region.lend(Access::REMOTE_WRITE).unwrap();
        let r = lease.remote();
        let h = Handle {
            addr: r.addr,
            len: r.len,
            rkey: r.rkey,
            write: true,
            fill: 5,
        };
        within(
            LIMIT,
            "bulk call",
            ch.unary::<_, Echo>(&BULK, Request::new(h)),
        )
        .await
        .unwrap();
    }
    assert!(region.iter().all(|&b| b == 5));
    within(LIMIT, "shutdown", server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutting_down_with_bulk_operations_and_reads_in_flight_frees_nothing_before_the_qps() {
    let _serial = SERIAL.lock().await;
    let server = owned_server().await;
    let addr = server.local_addr().to_string();
    let connect = || within(LIMIT, "connect", Channel::connect(addr.clone()));
    let (a, b) = (connect().await.unwrap(), connect().await.unwrap());
    let mut region = a.alloc_region(1 << 20).await.unwrap();
    region.fill(7);
    let lease = region.lend(Access::REMOTE_WRITE).unwrap();
    let before = quiet().await;
    // A handler's WRITE into the region, held posted on connection `a`...
    let write = held_bulk_call(&a, lease.remote(), true).await;
    // ...and a rendezvous request whose READ the server holds posted on connection `b`.
    arm_one_sided(OneSided::ServerRead, OneSidedFault::Delay(HOLD), 1);
    let echo = {
        let b = b.clone();
        tokio::spawn(async move {
            let req = Request::new(Echo {
                data: pattern(1 << 20, 4),
            });
            b.unary::<_, Echo>(&ECHO, req).await
        })
    };
    wait_until(LIMIT, "READ posted", || one_sided_left() == 0).await;
    disarm();
    assert_eq!(server.live_calls(), 2, "both calls are in flight");
    // Past the grace period the shard closes both connections: QPs first, then buffers.
    within(LIMIT, "shutdown", server.shutdown()).await;
    // The clients park what they lent (the request's payload) when they notice, and free it
    // only with their QPs; what is freed by now is the server's.
    let (p, freed) = delta(before);
    assert!(
        freed >= 2 && p >= freed,
        "the shard parked the bulk buffer and the READ target, then freed them after \
         destroying the QPs: {p} parked, {freed} freed"
    );
    for (what, r) in [
        ("bulk", within(LIMIT, "bulk call", write).await.unwrap()),
        ("echo", within(LIMIT, "echo call", echo).await.unwrap()),
    ] {
        let st = r.expect_err(what);
        assert_eq!(st.code(), Code::Unavailable, "{what}: {st:?}");
    }
    // The held WRITE never ran: its QP was destroyed first.
    // The server is gone; the lease ends and the bytes are ours again, unwritten.
    drop(lease);
    assert!(region.iter().all(|&b| b == 7));
    drop((region, a, b));
    wait_until(LIMIT, "clients free what they parked", || {
        let (p, freed) = delta(before);
        p == freed
    })
    .await;
}
