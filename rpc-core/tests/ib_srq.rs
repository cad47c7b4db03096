//! The `ib` provider's shared receive queues beyond the conformance cases: the depth enforced
//! at `max_wr` receives posted and not yet polled (credited by the receive CQ, whichever QP
//! consumed them), the receive CQ reserving the SRQ's depth once for all its QPs, and the
//! argument checks.
//!
//! On a host without an RDMA device every test prints `SKIP` and passes; inside the Soft-RoCE
//! VM (`SOFTROCE=1`) or with `RPC_IB_REQUIRE_DEVICE=1` a missing device is a failure.
#![cfg(feature = "ibverbs")]
#![allow(clippy::unwrap_used)] // test helpers panic on purpose: a failure is a test failure

use std::time::{Duration, Instant};

use rpc_core::verbs::ib::{Ib, IbContext, IbCq, IbMr, IbSrq};
use rpc_core::verbs::{
    Access, ConnectAttr, Context, Cq, ErrorKind, Mr, Pd, PostError, Provider, Qp, QpCaps, RecvWr,
    SendFlags, SendWr, Srq, SrqCaps, Wc, WcStatus, WrOp,
};

const WAIT: Duration = Duration::from_secs(20);
const BUF: usize = 64;

fn open_or_skip(test: &str) -> Option<IbContext> {
    let required = std::env::var_os("SOFTROCE").is_some()
        || std::env::var_os("RPC_IB_REQUIRE_DEVICE").is_some();
    match Ib::open(None) {
        Ok(c) => Some(c),
        Err(e) if e.kind() == ErrorKind::NoDevice && !required => {
            eprintln!("SKIP {test}: no RDMA device on this host ({e})");
            None
        }
        Err(e) => panic!("{test}: cannot open an RDMA device: {e}"),
    }
}

fn poll_n(cq: &mut IbCq, n: usize) -> Vec<Wc> {
    let mut out = Vec::new();
    let mut buf = [Wc::default(); 8];
    let t0 = Instant::now();
    while out.len() < n {
        let k = cq.poll(&mut buf).unwrap();
        out.extend_from_slice(&buf[..k]);
        assert!(t0.elapsed() < WAIT, "{} of {n} completions", out.len());
    }
    out
}

/// Posts receives `slots` (BUF bytes each of `mr`, `wr_id` = slot) in one call.
fn post(srq: &mut IbSrq, mr: &IbMr, slots: std::ops::Range<usize>) -> Result<(), PostError> {
    let sges: Vec<_> = slots
        .clone()
        .map(|s| mr.sge(s * BUF, BUF as u32).unwrap())
        .collect();
    let wrs: Vec<_> = slots
        .zip(&sges)
        .map(|(s, sge)| RecvWr {
            wr_id: s as u64,
            sg_list: std::slice::from_ref(sge),
        })
        .collect();
    // SAFETY: the region outlives the SRQ and its QPs and is not read by the test.
    unsafe { srq.post_recv(&wrs) }
}

fn caps(send: u32) -> QpCaps {
    QpCaps {
        max_send_wr: send,
        max_recv_wr: 0,
        max_send_sge: 1,
        max_recv_sge: 0,
        max_inline_data: 0,
    }
}

#[test]
fn srq_depth_is_enforced_and_credited_by_polls() {
    let Some(ctx) = open_or_skip("srq_depth_is_enforced_and_credited_by_polls") else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    let mr = pd.alloc_mr(64 * BUF, Access::ALL).unwrap();
    let mut cq_a = ctx.create_cq(64, None).unwrap();
    let mut cq_b = ctx.create_cq(64, None).unwrap();
    let mut srq = pd
        .create_srq(SrqCaps {
            max_wr: 4,
            max_sge: 1,
        })
        .unwrap();
    assert_eq!(
        srq.caps().max_wr,
        4,
        "the depth asked for, as on every provider"
    );
    let mut a = pd.create_qp_on_srq(&cq_a, &cq_a, caps(8), &srq).unwrap();
    assert_eq!((a.caps().max_recv_wr, a.caps().max_recv_sge), (0, 0));
    let plain = QpCaps {
        max_recv_wr: 8,
        max_recv_sge: 1,
        ..caps(8)
    };
    let mut b = pd.create_qp(&cq_b, &cq_b, plain).unwrap();
    let attr = ConnectAttr {
        rnr_retry: 7,
        ..ConnectAttr::default()
    };
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb, &attr).unwrap();
    b.connect(&ea, &attr).unwrap();

    // Too many SGEs is an argument error, found before anything is posted.
    let two = [mr.sge(0, 8).unwrap(), mr.sge(8, 8).unwrap()];
    let wr = RecvWr {
        wr_id: 9,
        sg_list: &two,
    };
    // SAFETY: refused before posting (max_sge 1).
    let e = unsafe { srq.post_recv(std::slice::from_ref(&wr)) }.unwrap_err();
    assert_eq!((e.posted, e.error.kind()), (0, ErrorKind::InvalidArgument));

    // Four fit, the fifth is back-pressure; a chain of three past two more is cut at the depth.
    post(&mut srq, &mr, 0..4).unwrap();
    let e = post(&mut srq, &mr, 4..5).unwrap_err();
    assert_eq!(
        (e.posted, e.error.kind()),
        (0, ErrorKind::QueueFull),
        "{e:?}"
    );
    let sge = mr.sge(63 * BUF, 8).unwrap();
    for k in 0..2 {
        let wr = SendWr {
            wr_id: k,
            op: WrOp::Send,
            sg_list: std::slice::from_ref(&sge),
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the source lives as long as the QP; nothing writes it.
        unsafe { b.post_send(std::slice::from_ref(&wr)) }.unwrap();
    }
    for wc in poll_n(&mut cq_b, 2) {
        assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
    }
    // Consumed but not polled yet: still counted.
    let e = post(&mut srq, &mr, 4..5).unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::QueueFull, "{e:?}");
    let got = poll_n(&mut cq_a, 2);
    let ids: Vec<u64> = got.iter().map(|w| w.wr_id).collect();
    assert_eq!(
        ids,
        [0, 1],
        "the callers' wr_ids, in the order posted: {got:?}"
    );
    assert!(got.iter().all(|w| w.qp_num == a.qp_num()), "{got:?}");
    let e = post(&mut srq, &mr, 4..7).unwrap_err();
    assert_eq!(
        (e.posted, e.error.kind()),
        (2, ErrorKind::QueueFull),
        "{e:?}"
    );
    // The slots freed by the polls carry the new receives' wr_ids: 2, 3 then 4, 5.
    for (k, want) in [[2u64, 3], [4, 5]].into_iter().enumerate() {
        for i in 0..2 {
            let wr = SendWr {
                wr_id: 10 + 2 * k as u64 + i,
                op: WrOp::Send,
                sg_list: std::slice::from_ref(&sge),
                flags: SendFlags::SIGNALED,
            };
            // SAFETY: as above.
            unsafe { b.post_send(std::slice::from_ref(&wr)) }.unwrap();
        }
        poll_n(&mut cq_b, 2);
        let ids: Vec<u64> = poll_n(&mut cq_a, 2).iter().map(|w| w.wr_id).collect();
        assert_eq!(ids, want);
    }
    post(&mut srq, &mr, 7..11).unwrap();
}

#[test]
fn receive_cq_reserves_the_srq_once() {
    let Some(ctx) = open_or_skip("receive_cq_reserves_the_srq_once") else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    let srq = pd
        .create_srq(SrqCaps {
            max_wr: 16,
            max_sge: 1,
        })
        .unwrap();
    // 3 QPs x 8 sends + the SRQ's 16 receives once = 40.
    let cq = ctx.create_cq(40, None).unwrap();
    let q1 = pd.create_qp_on_srq(&cq, &cq, caps(8), &srq).unwrap();
    let q2 = pd.create_qp_on_srq(&cq, &cq, caps(8), &srq).unwrap();
    let q3 = pd.create_qp_on_srq(&cq, &cq, caps(8), &srq).unwrap();
    let e = pd.create_qp_on_srq(&cq, &cq, caps(1), &srq).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ExceedsCaps, "{e}");
    drop(q3);
    let q3 = pd.create_qp_on_srq(&cq, &cq, caps(8), &srq).unwrap();
    // Another receive CQ reserves the SRQ's receives on its own.
    let send_cq = ctx.create_cq(8, None).unwrap();
    let small = ctx.create_cq(15, None).unwrap();
    let e = pd
        .create_qp_on_srq(&send_cq, &small, caps(8), &srq)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ExceedsCaps, "{e}");
    assert!(e.to_string().contains("SRQ"), "{e}");
    // The SRQ's handle goes first; its QPs keep it until the last is destroyed.
    drop(srq);
    drop((q1, q2));
    drop(q3);
}

#[test]
fn srq_arguments_are_checked() {
    let Some(ctx) = open_or_skip("srq_arguments_are_checked") else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    for bad in [
        SrqCaps {
            max_wr: 0,
            max_sge: 1,
        },
        SrqCaps {
            max_wr: u32::MAX,
            max_sge: 1,
        },
        SrqCaps {
            max_wr: 4,
            max_sge: u32::MAX,
        },
    ] {
        let e = pd.create_srq(bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ExceedsCaps, "{bad:?}: {e}");
    }
    let mut srq = pd.create_srq(SrqCaps::default()).unwrap();
    let e = srq.arm_limit(srq.caps().max_wr + 1).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    srq.arm_limit(0).unwrap();
    // An SRQ of another PD is refused.
    let other = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(2048, None).unwrap();
    let e = other.create_qp_on_srq(&cq, &cq, caps(4), &srq).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::WrongPd, "{e}");
}
