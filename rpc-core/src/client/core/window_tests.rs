//! A receive window that cannot grow (registering its next region fails, as with
//! RLIMIT_MEMLOCK reached): the connection keeps the window it has, and calls that need more
//! wait for credits instead of failing or losing anything.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use crate::client::{AnyCore, Channel, ClientPoller};
use crate::server::{Dispatched, IncomingCall, Server, Service};
use crate::{CallKind, Geometry, MethodDesc, Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
struct Num {
    #[prost(uint64, tag = "1")]
    seq: u64,
}

static SLOW: MethodDesc = MethodDesc::new("/window.Slow/Slow", CallKind::Unary);
static METHODS: [MethodDesc; 1] = [SLOW];

/// Answers each call after 20 ms, so that many are in flight at once.
struct SlowSvc;

impl Service for SlowSvc {
    fn name(&self) -> &'static str {
        "window.Slow"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, _method: u32, call: IncomingCall<'_>) -> Dispatched {
        call.unary(|req: Request<Num>| async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            Ok(Response::new(req.into_inner()))
        })
    }
}

/// `n` slow calls at once; each must answer with its own number.
async fn slow_calls(ch: &Channel, from: u64, n: u64) {
    let calls = (from..from + n).map(|seq| {
        let ch = ch.clone();
        tokio::spawn(async move {
            let mut req = Request::new(Num { seq });
            req.set_timeout(Duration::from_secs(30));
            let r = tokio::time::timeout(Duration::from_secs(60), ch.unary::<Num, Num>(&SLOW, req))
                .await
                .map_err(|_| Status::deadline_exceeded("no answer in 60 s"))?;
            r.map(|r| r.into_inner().seq)
        })
    });
    for (seq, c) in (from..).zip(futures_util::future::join_all(calls).await) {
        assert_eq!(
            c.unwrap().unwrap_or_else(|s| panic!("call {seq}: {s}")),
            seq
        );
    }
}

#[allow(irrefutable_let_patterns)] // refutable with the ibverbs feature
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_that_cannot_grow_keeps_serving_its_calls() {
    let server = Server::builder()
        .add_service(SlowSvc)
        .bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = server.local_addr().to_string();
    let geometry = Geometry {
        recv_slots: 64,
        ..Geometry::default()
    };
    for poller in [ClientPoller::Thread, ClientPoller::Caller] {
        let connect = || {
            Channel::builder(addr.clone())
                .poller(poller)
                .geometry(geometry)
                .connect()
        };
        let stuck = connect().await.expect("connect");
        let grows = connect().await.expect("connect");
        let conn = stuck.current().expect("a connection");
        let AnyCore::Soft(core) = &conn.core else {
            println!("skipped: the test's fault hook is in the soft provider's arena");
            return;
        };
        assert_eq!(stuck.slots().recv_window, 8, "{poller:?}");
        core.arena.refuse_growth();
        // 48 calls at once: far more than the 6 credits of a window of 8 (2 kept for
        // control frames). The server waits for credits as slots come back.
        slow_calls(&stuck, 0, 48).await;
        slow_calls(&grows, 0, 48).await;
        assert_eq!(stuck.slots().recv_window, 8, "{poller:?}: never grew");
        assert!(
            grows.slots().recv_window >= 32,
            "{poller:?}: the same calls grow a window that can: {:?}",
            grows.slots()
        );
        // Still whole: more calls, and one at a time.
        slow_calls(&stuck, 100, 24).await;
        slow_calls(&stuck, 200, 1).await;
        assert_eq!(stuck.slots().recv_window, 8);
    }
}
