//! A rogue client against the server's memory loans, at the RPC layer: it takes the keys the
//! server lent for rendezvous responses (its own, and a victim connection's, read off the
//! drivers) and, once those loans ended, posts RDMA WRITEs of garbage and READs through them
//! on its own QP. Every such access must fail with REM_ACCESS_ERR (breaking the rogue's
//! connection only), and a victim checking every byte of 1 MiB responses meanwhile must see
//! none changed. Before keys were revoked at release, such WRITEs succeeded and corrupted
//! other clients' responses.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;

use super::{AnyCore, Channel, ClientPoller};
use crate::server::{Dispatched, IncomingCall, Server, Service};
use crate::verbs::{Qp, SendFlags, SendWr, Wc, WcStatus, WrOp};
use crate::wire::BulkDesc;
use crate::{CallKind, MethodDesc, Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
struct Gen {
    #[prost(uint64, tag = "1")]
    seq: u64,
    #[prost(uint64, tag = "2")]
    len: u64,
}

/// A numbered blob (the window tests' answers too).
#[derive(Clone, PartialEq, prost::Message)]
pub(super) struct Blob {
    #[prost(uint64, tag = "1")]
    pub(super) seq: u64,
    #[prost(bytes = "bytes", tag = "2")]
    pub(super) data: Bytes,
}

static GEN: MethodDesc = MethodDesc::new("/rogue.Gen/Gen", CallKind::Unary);
static METHODS: [MethodDesc; 1] = [GEN];

/// Bytes every response is a slice of (at an offset its sequence number picks).
fn table() -> &'static [u8] {
    static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..(2usize << 20))
            .map(|i| (i % 251) as u8 ^ (i >> 9) as u8)
            .collect()
    })
}

/// Response `seq` of `len` bytes.
fn expected(seq: u64, len: usize) -> &'static [u8] {
    let off = (seq % 4093) as usize;
    &table()[off..off + len]
}

/// Answers `len` bytes of the pattern of `seq`.
struct GenSvc;

impl Service for GenSvc {
    fn name(&self) -> &'static str {
        "rogue.Gen"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, _method: u32, call: IncomingCall<'_>) -> Dispatched {
        call.unary(|req: Request<Gen>| async move {
            let g = req.into_inner();
            let len = (g.len as usize).min(1 << 20);
            Ok(Response::new(Blob {
                seq: g.seq,
                data: Bytes::from_static(expected(g.seq, len)),
            }))
        })
    }
}

async fn call_gen(ch: &Channel, seq: u64, len: usize) -> Result<Blob, Status> {
    let mut req = Request::new(Gen {
        seq,
        len: len as u64,
    });
    req.set_timeout(Duration::from_secs(20));
    let r = tokio::time::timeout(Duration::from_secs(30), ch.unary::<Gen, Blob>(&GEN, req))
        .await
        .map_err(|_| Status::deadline_exceeded("no answer in 30 s"))?;
    r.map(Response::into_inner)
}

#[allow(irrefutable_let_patterns)] // refutable with the ibverbs feature
/// The last rendezvous descriptor the channel's driver received (the driver is free between
/// calls of a `ClientPoller::Caller` channel).
fn last_bulk(ch: &Channel) -> Option<BulkDesc> {
    let conn = ch.current().expect("a connection");
    let AnyCore::Soft(core) = &conn.core else {
        return None;
    };
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(5) {
        if let Some(d) = core.driver.try_lock() {
            return d.seen_bulk.last().copied();
        }
        std::thread::yield_now();
    }
    None
}

#[allow(irrefutable_let_patterns)] // refutable with the ibverbs feature
/// Posts `op` of `len` bytes through `desc` on the channel's own QP and returns the status of
/// its completion.
fn replay(ch: &Channel, desc: BulkDesc, write: bool, len: u32) -> WcStatus {
    let conn = ch.current().expect("a connection");
    let AnyCore::Soft(core) = &conn.core else {
        panic!("soft provider expected");
    };
    let mut local = core.bulk.get(len as usize).expect("a local buffer");
    local.as_mut_slice().fill(0xEE);
    let start = Instant::now();
    let mut d = loop {
        if let Some(d) = core.driver.try_lock() {
            break d;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "driver busy");
        std::thread::yield_now();
    };
    let op = if write {
        WrOp::Write {
            remote_addr: desc.addr,
            rkey: desc.rkey,
        }
    } else {
        WrOp::Read {
            remote_addr: desc.addr,
            rkey: desc.rkey,
        }
    };
    const ROGUE: u64 = 0xbad0_bad0_bad0_bad0;
    let sge = [local.sge(0, len).expect("sge")];
    let wr = [SendWr {
        wr_id: ROGUE,
        op,
        sg_list: &sge,
        flags: SendFlags::SIGNALED,
    }];
    // SAFETY: `local` outlives the completion polled below (or the QP: the connection is
    // dropped after this function returns, and `local` with it, only once it completed).
    unsafe { d.link.qp.post_send(&wr) }.expect("post the rogue access");
    let mut wcs = [Wc::default(); 16];
    loop {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no completion for the rogue access"
        );
        let n = d.cqs.poll(&mut wcs).expect("poll");
        if let Some(wc) = wcs[..n].iter().find(|w| w.wr_id == ROGUE) {
            return wc.status;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ended_loans_are_closed_to_every_peer_and_the_victim_sees_no_corruption() {
    const LEN: usize = 1 << 20;
    let victim_calls: u64 = 1000;
    let server = Server::builder()
        .add_service(GenSvc)
        .bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = server.local_addr().to_string();
    let connect = |addr: String| async move {
        // Every response by rendezvous (READ), so that its keys can be taken.
        Channel::builder(addr)
            .poller(ClientPoller::Caller)
            .learn_response_sizes(false)
            .connect()
            .await
            .expect("connect")
    };
    let victim = connect(addr.clone()).await;
    let published: Arc<Mutex<Option<BulkDesc>>> = Arc::new(Mutex::new(None));
    let done = Arc::new(AtomicBool::new(false));
    let checked = Arc::new(AtomicU64::new(0));
    let victim_task = {
        let (published, done, checked) = (published.clone(), done.clone(), checked.clone());
        tokio::spawn(async move {
            let mut seq = 0;
            // At least `victim_calls`, and on until the rogue has made its attempts.
            while seq < victim_calls || !done.load(Ordering::Acquire) {
                let b = call_gen(&victim, seq, LEN)
                    .await
                    .unwrap_or_else(|s| panic!("victim call {seq}: {s}"));
                assert_eq!(b.seq, seq);
                assert_eq!(b.data.len(), LEN);
                if b.data[..] != *expected(seq, LEN) {
                    let want = expected(seq, LEN);
                    let i = (0..LEN).find(|&i| b.data[i] != want[i]).unwrap_or(0);
                    panic!("victim response {seq}: byte {i} corrupted");
                }
                checked.fetch_add(1, Ordering::Relaxed);
                if let Some(d) = last_bulk(&victim) {
                    *published.lock().unwrap() = Some(d);
                }
                seq += 1;
            }
        })
    };
    // The rogue: each attempt breaks its connection (RC), so each uses a fresh one.
    let mut attempts = [0u32; 3];
    let mut k = 0u64;
    const ATTEMPTS: u64 = 60;
    while k < ATTEMPTS {
        let rogue = connect(addr.clone()).await;
        let own = call_gen(&rogue, 1_000_000 + k, LEN)
            .await
            .expect("rogue's own call");
        assert_eq!(own.data.len(), LEN);
        let own_key = last_bulk(&rogue).expect("the rogue saw a rendezvous key");
        // Its loan ended with its BulkRelease. A small call after it makes sure the release
        // was posted and taken: the server handles frames in order, and the small response
        // comes after the release was handled.
        call_gen(&rogue, 2_000_000 + k, 16)
            .await
            .expect("rogue's small call");
        let victims = *published.lock().unwrap();
        let (case, desc, write, len) = match (k % 3, victims) {
            (0, _) => (0, own_key, true, 4096),
            (1, _) => (1, own_key, false, 4096),
            (_, Some(v)) => (2, v, true, 64 << 10),
            (_, None) => (0, own_key, true, 4096),
        };
        let rogue2 = rogue.clone();
        let status = tokio::task::spawn_blocking(move || replay(&rogue2, desc, write, len))
            .await
            .unwrap();
        assert_eq!(
            status,
            WcStatus::RemAccessErr,
            "rogue access {k} (case {case}: {}) through an ended loan",
            ["own key, WRITE", "own key, READ", "victim's key, WRITE"][case]
        );
        attempts[case] += 1;
        k += 1;
    }
    done.store(true, Ordering::Release);
    tokio::time::timeout(Duration::from_secs(120), victim_task)
        .await
        .expect("victim finished")
        .unwrap();
    let checked = checked.load(Ordering::Relaxed);
    eprintln!(
        "rogue accesses by kind {attempts:?}, all refused; victim responses checked: {checked}"
    );
    assert!(checked >= victim_calls);
    assert!(
        attempts.iter().all(|&n| n > 0),
        "every kind of rogue access was tried: {attempts:?}"
    );
    server.shutdown().await;
}
