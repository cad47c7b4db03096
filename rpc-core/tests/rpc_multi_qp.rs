//! Several RC queue pairs per connection (`qps_per_connection`, like
//! `NCCL_IB_QPS_PER_CONNECTION`): how many a connection gets when both sides ask, and that
//! every large transfer (request READ, landing-zone WRITE_WITH_IMM, rendezvous response READ)
//! striped over the data QPs arrives whole. Runs on `RPC_PROVIDER` (soft by default), and
//! across two hosts with `RPC_TEST_REMOTE` (see `common::remote`; `softroce/ci.sh` runs it
//! between two VMs): then the server-side striping counters are not checked.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::*;
use prost::Message;
use rpc_core::{ClientPoller, Request, Response};

/// Transfers of at least this many bytes are striped (the link's `STRIPE_MIN`).
const STRIPE_MIN: usize = 256 << 10;

const QPS3: Slot = Slot {
    offset: 0,
    config: |b| b.qps_per_connection(3),
};
const QPS4: Slot = Slot {
    offset: 1,
    config: |b| b.qps_per_connection(4),
};
const QPS2: Slot = Slot {
    offset: 2,
    config: |b| b.qps_per_connection(2),
};
const DEFAULT: Slot = Slot {
    offset: 3,
    config: |b| b,
};

/// The server side of a two-host run: every slot above, until stdin closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the server side of a two-host run (softroce/vm.sh pair sets RPC_TEST_SERVE)"]
async fn serve_for_the_pair() {
    serve_lab(&[QPS3, QPS4, QPS2, DEFAULT]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_uses_as_many_qps_as_both_sides_allow() {
    let srv = Target::start(&QPS3).await;
    for (asked, got) in [(1, 1), (2, 2), (3, 3), (8, 3), (16, 3), (0, 1), (99, 3)] {
        let ch = within(
            Duration::from_secs(20),
            "connect",
            srv.builder().qps_per_connection(asked).connect(),
        )
        .await
        .expect("connects");
        assert_eq!(ch.qps_per_connection(), got, "client asked for {asked}");
        // Small and striped calls work on it.
        for n in [10usize, 1 << 20] {
            echo_ok(&ch, Api::Async, 7, n, &format!("{asked} QPs asked, {n} B")).await;
        }
    }
    // A server left at the provider's default (1 on soft unless configured) gives one QP.
    let one = Target::start(&DEFAULT).await;
    let ch = one.builder().qps_per_connection(4).connect().await.unwrap();
    let expect = if std::env::var("RPC_IB_QPS_PER_CONNECTION").is_ok() {
        ch.qps_per_connection()
    } else {
        1
    };
    assert_eq!(ch.qps_per_connection(), expect);
    srv.settle("live calls back to 0").await;
}

/// Echo, generate and sink across the striping threshold and the 4 MiB chunk size, over four
/// QPs, checking every byte and that the large transfers really went over the data QPs.
async fn striped_matrix(mode: ClientPoller, api: Api) {
    let srv = Target::start(&QPS4).await;
    let ch = within(
        Duration::from_secs(20),
        "connect",
        // Unhinted responses READ every time (no zone learned), hinted ones WRITTEN.
        srv.builder()
            .poller(mode)
            .qps_per_connection(4)
            .learn_response_sizes(false)
            .connect(),
    )
    .await
    .expect("connects");
    assert_eq!(ch.qps_per_connection(), 4);
    let mut sizes = vec![
        64 << 10,
        STRIPE_MIN - 100,
        STRIPE_MIN + 1,
        (1 << 20) + 12345,
        (5 << 20) + 7,
        17 << 20,
        64 << 20,
    ];
    sizes.iter_mut().for_each(|n| *n = (*n).min(max_payload()));
    sizes.dedup();
    for (i, n) in sizes.into_iter().enumerate() {
        let seq = 100 + i as u64;
        let blob = Blob {
            seq,
            data: pattern(n, seq),
        };
        let enc = blob.encoded_len();
        for hint in [None, Some(enc)] {
            let what = format!("{mode:?}/{api:?} echo {n} B over 4 QPs, hint {hint:?}");
            let mut req = Request::new(blob.clone());
            if let Some(h) = hint {
                req.set_response_size_hint(h);
            }
            let server_striped = || srv.local().map_or(0, |s| s.server.striped_bytes());
            let (srv0, ch0) = (server_striped(), ch.striped_bytes());
            let r: Response<Blob> = call(&ch, api, &lab_server::ECHO, req)
                .await
                .unwrap_or_else(|e| panic!("{what}: {e:?}"));
            check_blob(r.get_ref(), seq, n, &what);
            let (srv1, ch1) = (server_striped(), ch.striped_bytes());
            if enc >= STRIPE_MIN {
                // The server READ the request and (with a hint) WROTE the response striped;
                // without a hint the client READ the response striped.
                let server_side = if hint.is_some() { 2 * enc } else { enc };
                assert!(
                    srv.local().is_none() || srv1 - srv0 >= server_side as u64,
                    "{what}: server striped {} bytes",
                    srv1 - srv0
                );
                if hint.is_none() {
                    assert!(
                        ch1 - ch0 >= enc as u64,
                        "{what}: client striped {}",
                        ch1 - ch0
                    );
                }
            } else {
                assert_eq!(
                    (srv1, ch1),
                    (srv0, ch0),
                    "{what}: small transfers use one QP"
                );
            }
        }
        let what = format!("{mode:?}/{api:?} generate {n} B over 4 QPs");
        let r: Response<Blob> = call(
            &ch,
            api,
            &lab_server::GENERATE,
            Request::new(GenRequest { seq, len: n as u64 }),
        )
        .await
        .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        check_blob(r.get_ref(), seq, n, &what);
        let what = format!("{mode:?}/{api:?} sink {n} B over 4 QPs");
        let d: Response<Digest> = call(&ch, api, &lab_server::SINK, Request::new(blob))
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"));
        let d = d.into_inner();
        assert_eq!((d.seq, d.len), (seq, n as u64), "{what}");
        assert!(d.pattern_ok, "{what}: the server saw other bytes");
    }
    assert!(ch.is_connected());
    srv.settle("live calls back to 0").await;
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn striped_echo_thread_poller_async() {
    striped_matrix(ClientPoller::Thread, Api::Async).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn striped_echo_caller_poller_blocking() {
    striped_matrix(ClientPoller::Caller, Api::Blocking).await;
}

/// Many large calls at once: more striped transfers than a lane's send queue or the slot
/// table holds fall back to the primary QP, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_striped_calls_at_once() {
    let srv = Target::start(&QPS2).await;
    let ch = srv
        .builder()
        .qps_per_connection(2)
        .max_concurrent_calls(128)
        .connect()
        .await
        .unwrap();
    let n = (512 << 10).min(max_payload());
    let calls = scaled(96) as u64;
    let mut set = tokio::task::JoinSet::new();
    for seq in 0..calls {
        let ch = ch.clone();
        set.spawn(async move {
            let mut req = Request::new(Blob {
                seq,
                data: pattern(n, seq),
            });
            if seq % 2 == 0 {
                req.set_response_size_hint(n + 32);
            }
            let r: Response<Blob> = ch.unary(&lab_server::ECHO, req).await.unwrap();
            check_blob(r.get_ref(), seq, n, "concurrent striped echo");
        });
    }
    within(Duration::from_secs(120), "all calls", async {
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
    })
    .await;
    if let Some(s) = srv.local() {
        assert!(s.server.striped_bytes() > 0);
    } else {
        assert!(ch.striped_bytes() > 0, "the client striped nothing");
    }
    srv.settle("live calls back to 0").await;
}
