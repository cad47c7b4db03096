//! Shared receive queues: side A receives through one SRQ for several QPs, side B sends over
//! plain QPs. Same conventions as `cases`: both sides run the function and branch on `s.role`.

use std::time::{Duration, Instant};

use rpc_core::verbs::{
    AsyncEvent, ConnectAttr, Context, Cq, Endpoint, ErrorKind, Mr, Pd, Provider, Qp, QpCaps,
    QpState, RecvWr, SendFlags, Srq, SrqCaps, WcOpcode, WcStatus, WrOp,
};

use super::harness::*;

const SIG: SendFlags = SendFlags::SIGNALED;

/// Bytes per receive buffer.
const BUF: usize = 64;

/// What a side holds: on A every QP is created on `srq`, on B the QPs are plain.
struct Pairs<P: Provider> {
    pd: P::Pd,
    cq: P::Cq,
    srq: Option<P::Srq>,
    qps: Vec<P::Qp>,
}

/// Creates `n` QPs on each side (A's on one SRQ of `srq_wr` receives, all on one CQ) and
/// connects them pairwise with `attrs[i]`; both sides are in RTS when it returns.
fn pairs<P: Provider>(s: &mut Side<P>, srq_wr: u32, attrs: &[ConnectAttr]) -> Pairs<P> {
    let n = attrs.len();
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: if s.role == Role::A { 0 } else { 16 },
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let pd = s.ctx.alloc_pd().expect("alloc_pd");
    let cq = s
        .ctx
        .create_cq(n as u32 * 32 + srq_wr, None)
        .expect("create_cq");
    let srq = (s.role == Role::A).then(|| {
        pd.create_srq(SrqCaps {
            max_wr: srq_wr,
            max_sge: 1,
        })
        .expect("create_srq")
    });
    let mut qps: Vec<P::Qp> = (0..n)
        .map(|i| {
            let mut q = match &srq {
                Some(srq) => pd.create_qp_on_srq(&cq, &cq, caps, srq),
                None => pd.create_qp(&cq, &cq, caps),
            }
            .expect("create_qp");
            q.modify_to_init(attrs[i].access).expect("modify_to_init");
            q
        })
        .collect();
    // What the QPs reserve on the CQ: their send queues, and the SRQ's receives once (on B,
    // each QP's own receive queue).
    let reserved = match s.role {
        Role::A => n as u32 * 16 + srq_wr,
        Role::B => n as u32 * 32,
    };
    assert_eq!(
        cq.room(),
        cq.capacity() - reserved,
        "room left on a CQ of {} entries with {n} QPs",
        cq.capacity()
    );
    let mine: Vec<u8> = qps.iter().flat_map(|q| q.endpoint().to_bytes()).collect();
    s.send(&mine);
    let theirs = s.recv();
    for (i, q) in qps.iter_mut().enumerate() {
        let ep = Endpoint::from_bytes(&theirs[i * Endpoint::ENCODED_LEN..]).expect("endpoint");
        q.connect(&ep, &attrs[i]).expect("connect");
        assert_eq!(q.state(), QpState::Rts);
    }
    s.barrier();
    Pairs { pd, cq, srq, qps }
}

/// Posts receive `slot` of `mr` (BUF bytes at `slot * BUF`) to the SRQ, `wr_id` = slot.
fn post_srq<S: Srq, M: Mr>(srq: &mut S, mr: &M, slot: usize) {
    let sge = mr.sge(slot * BUF, BUF as u32).expect("sge");
    let wr = RecvWr {
        wr_id: slot as u64,
        sg_list: std::slice::from_ref(&sge),
    };
    // SAFETY: the region outlives the SRQ's QPs and is read only after the completion.
    unsafe { srq.post_recv(std::slice::from_ref(&wr)) }.expect("post_srq_recv");
}

/// An attribute set that waits for receives as long as it takes (rnr_retry 7).
fn patient() -> ConnectAttr {
    ConnectAttr {
        rnr_retry: 7,
        min_rnr_timer: 12,
        ..ConnectAttr::default()
    }
}

/// Six QPs receive through one SRQ of 16 receives: 8 messages on each (48, three times the
/// SRQ's depth, so A reposts as it polls and B's SENDs wait for receives now and then). Every
/// completion names the QP the message came over, and each QP's messages arrive in order.
pub fn srq_many_qps<P: Provider>(s: &mut Side<P>) {
    const N: usize = 6;
    const K: usize = 8;
    const DEPTH: usize = 16;
    let mut p = pairs(s, DEPTH as u32, &[patient(); N]);
    match s.role {
        Role::A => {
            let mr = mr_all::<P>(&p.pd, DEPTH * BUF);
            let srq = p.srq.as_mut().expect("A has the SRQ");
            assert!(srq.caps().max_wr >= DEPTH as u32, "{:?}", srq.caps());
            for slot in 0..DEPTH {
                post_srq(srq, &mr, slot);
            }
            s.send(b"posted");
            let mut next = [0u8; N];
            for _ in 0..N * K {
                let wc = poll_n(&mut p.cq, 1)[0];
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                assert_eq!(wc.opcode, WcOpcode::Recv, "{wc:?}");
                assert_eq!(wc.byte_len, 2, "{wc:?}");
                let slot = wc.wr_id as usize;
                assert!(slot < DEPTH, "{wc:?}");
                let msg = read_mr(&mr, slot * BUF, 2);
                let i = msg[0] as usize;
                assert!(i < N, "payload {msg:?}");
                assert_eq!(
                    wc.qp_num,
                    p.qps[i].qp_num(),
                    "message of QP {i} completed naming another QP: {wc:?}"
                );
                assert_eq!(msg[1], next[i], "QP {i}: messages out of order");
                next[i] += 1;
                post_srq(srq, &mr, slot);
            }
            assert!(next.iter().all(|&k| k as usize == K), "{next:?}");
            s.barrier();
        }
        Role::B => {
            assert_eq!(s.recv(), b"posted");
            let mr = mr_all::<P>(&p.pd, N * K * 2);
            for k in 0..K {
                for (i, qp) in p.qps.iter_mut().enumerate() {
                    let off = (k * N + i) * 2;
                    write_mr(&mr, off, &[i as u8, k as u8]);
                    post_send(qp, off as u64, WrOp::Send, &[mr.sge(off, 2).unwrap()], SIG);
                }
                for wc in poll_n(&mut p.cq, N) {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                }
            }
            s.barrier();
        }
    }
}

/// An empty SRQ makes SENDs wait (RNR) until a receive is posted; with few RNR retries
/// they fail with RNR_RETRY_EXC_ERR instead, and that QP's failure leaves the SRQ usable by
/// the other.
pub fn srq_empty_rnr<P: Provider>(s: &mut Side<P>) {
    let impatient = ConnectAttr {
        rnr_retry: 1,
        min_rnr_timer: 12,
        ..ConnectAttr::default()
    };
    let mut p = pairs(s, 8, &[patient(), impatient]);
    match s.role {
        Role::A => {
            let mr = mr_all::<P>(&p.pd, 8 * BUF);
            // QP 1's SEND finds the SRQ empty and gives up.
            s.send(b"go1");
            assert_eq!(s.recv(), b"failed1");
            // QP 0's SEND waits for the receive posted 100 ms after it was sent.
            s.send(b"go0");
            assert_eq!(s.recv(), b"sent0");
            std::thread::sleep(Duration::from_millis(100));
            let srq = p.srq.as_mut().expect("A has the SRQ");
            post_srq(srq, &mr, 3);
            let wcs = poll_n(&mut p.cq, 1);
            assert_ok(&wcs[0], 3);
            assert_eq!(wcs[0].qp_num, p.qps[0].qp_num(), "{wcs:?}");
            assert_eq!(read_mr(&mr, 3 * BUF, 4), b"late");
            s.barrier();
        }
        Role::B => {
            let mr = mr_all::<P>(&p.pd, 4096);
            write_mr(&mr, 0, b"late");
            assert_eq!(s.recv(), b"go1");
            post_send(&mut p.qps[1], 11, WrOp::Send, &[mr.sge(0, 4).unwrap()], SIG);
            let wc = poll_n(&mut p.cq, 1)[0];
            assert_eq!(wc.wr_id, 11, "{wc:?}");
            assert_eq!(wc.status, WcStatus::RnrRetryExcErr, "{wc:?}");
            assert_state_becomes(&p.qps[1], QpState::Error, "QP 1 after RNR_RETRY_EXC_ERR");
            s.send(b"failed1");
            assert_eq!(s.recv(), b"go0");
            let t0 = Instant::now();
            post_send(&mut p.qps[0], 10, WrOp::Send, &[mr.sge(0, 4).unwrap()], SIG);
            s.send(b"sent0");
            let wc = poll_n(&mut p.cq, 1)[0];
            assert_ok(&wc, 10);
            assert!(
                t0.elapsed() >= Duration::from_millis(50),
                "completed after {:?}, before the receive was posted",
                t0.elapsed()
            );
            s.barrier();
        }
    }
}

/// The limit event: 8 receives posted, limit 4 armed; after 3 SENDs (5 left) no event, after
/// the 5th (3 left) one `SrqLimitReached` naming the SRQ, and none again (disarmed) after
/// more. A limit above the SRQ's depth is refused.
pub fn srq_limit_event<P: Provider>(s: &mut Side<P>) {
    let mut p = pairs(s, 16, &[patient()]);
    match s.role {
        Role::A => {
            let mr = mr_all::<P>(&p.pd, 16 * BUF);
            let srq = p.srq.as_mut().expect("A has the SRQ");
            let num = srq.srq_num();
            let depth = srq.caps().max_wr;
            let e = srq.arm_limit(depth + 1).expect_err("a limit above max_wr");
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
            for slot in 0..8 {
                post_srq(srq, &mr, slot);
            }
            srq.arm_limit(4).expect("arm_limit");
            s.send(b"3");
            assert_eq!(poll_n(&mut p.cq, 3).len(), 3);
            assert!(
                !limit_event(&s.ctx, num, Duration::from_millis(200)),
                "limit event with 5 receives left, above the limit of 4"
            );
            s.send(b"2");
            assert_eq!(poll_n(&mut p.cq, 2).len(), 2);
            assert!(
                limit_event(&s.ctx, num, Duration::from_secs(5)),
                "no limit event with 3 receives left, under the limit of 4"
            );
            s.send(b"1");
            assert_eq!(poll_n(&mut p.cq, 1).len(), 1);
            assert!(
                !limit_event(&s.ctx, num, Duration::from_millis(200)),
                "a second limit event: the limit must disarm when it fires"
            );
            s.barrier();
        }
        Role::B => {
            let mr = mr_all::<P>(&p.pd, 4096);
            for _ in 0..3 {
                let n: usize = String::from_utf8(s.recv()).unwrap().parse().unwrap();
                for k in 0..n {
                    post_send(
                        &mut p.qps[0],
                        k as u64,
                        WrOp::Send,
                        &[mr.sge(0, 8).unwrap()],
                        SIG,
                    );
                }
                for wc in poll_n(&mut p.cq, n) {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                }
            }
            s.barrier();
        }
    }
}

/// Whether `SrqLimitReached` for `srq_num` arrives within `d` (other events are skipped).
fn limit_event<C: Context<P>, P: Provider>(ctx: &C, srq_num: u32, d: Duration) -> bool {
    let t0 = Instant::now();
    loop {
        match ctx.poll_async_event().expect("poll_async_event") {
            Some(AsyncEvent::SrqLimitReached { srq_num: n }) if n == srq_num => return true,
            Some(e) => assert!(!e.is_fatal(), "fatal event: {e:?}"),
            None if t0.elapsed() >= d => return false,
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    }
}

/// A QP of the SRQ moved to ERROR flushes its own send work but not the SRQ's receives: no
/// receive completion appears for it, and the other QP's messages consume the receives
/// posted before the failure.
pub fn srq_qp_error_keeps_receives<P: Provider>(s: &mut Side<P>) {
    const POSTED: usize = 4;
    let mut p = pairs(s, 8, &[patient(), patient()]);
    match s.role {
        Role::A => {
            let mr = mr_all::<P>(&p.pd, 8 * BUF);
            let srq = p.srq.as_mut().expect("A has the SRQ");
            for slot in 0..POSTED {
                post_srq(srq, &mr, slot);
            }
            p.qps[0].modify_to_error().expect("modify_to_error");
            assert_eq!(p.qps[0].state(), QpState::Error);
            post_send(&mut p.qps[0], 77, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
            let wc = poll_n(&mut p.cq, 1)[0];
            assert_eq!((wc.wr_id, wc.status), (77, WcStatus::WrFlushErr), "{wc:?}");
            let extra = poll_for(&mut p.cq, Duration::from_millis(200));
            assert!(
                extra.is_empty(),
                "the SRQ's receives were flushed with the QP: {extra:?}"
            );
            let e = post_recv_err(&mut p.qps[1], &mr);
            assert_eq!(e, ErrorKind::InvalidArgument, "post_recv on a QP of an SRQ");
            s.send(b"send");
            let wcs = poll_n(&mut p.cq, POSTED);
            for wc in &wcs {
                assert_eq!(wc.status, WcStatus::Success, "{wcs:?}");
                assert_eq!(wc.qp_num, p.qps[1].qp_num(), "{wcs:?}");
            }
            let mut slots: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
            slots.sort_unstable();
            assert_eq!(slots, (0..POSTED as u64).collect::<Vec<_>>());
            s.barrier();
        }
        Role::B => {
            let mr = mr_all::<P>(&p.pd, 4096);
            assert_eq!(s.recv(), b"send");
            for k in 0..POSTED {
                post_send(
                    &mut p.qps[1],
                    k as u64,
                    WrOp::Send,
                    &[mr.sge(0, 8).unwrap()],
                    SIG,
                );
            }
            for wc in poll_n(&mut p.cq, POSTED) {
                assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            }
            s.barrier();
        }
    }
}

/// The error kind of a refused `post_recv` on `qp` (panics if it was accepted).
fn post_recv_err<Q: Qp, M: Mr>(qp: &mut Q, mr: &M) -> ErrorKind {
    let sge = mr.sge(7 * BUF, BUF as u32).expect("sge");
    let wr = RecvWr {
        wr_id: 7,
        sg_list: std::slice::from_ref(&sge),
    };
    // SAFETY: the region outlives the QP; a refused receive names nothing afterwards.
    match unsafe { qp.post_recv(std::slice::from_ref(&wr)) } {
        Ok(()) => panic!("post_recv on a QP of an SRQ was accepted"),
        Err(e) => e.error.kind(),
    }
}

/// Minor page faults this thread has taken so far (`getrusage(RUSAGE_THREAD)`).
fn thread_faults() -> i64 {
    // SAFETY: `getrusage` fills the zeroed struct it is given; nothing else is touched.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut u) };
    assert_eq!(rc, 0, "getrusage");
    u.ru_minflt
}

/// Soft provider only: a deep SRQ (the size a server shard's default pool asks for) is walked
/// without page faults. Posting (A) and SENDing into it (B) move along rings of megabytes;
/// pages first touched there were a fault every few hundred messages on the data path (the
/// tail of every small call). A's posts and B's SENDs over 4096 messages take at most a few.
pub fn srq_walk_takes_no_page_faults<P: Provider>(s: &mut Side<P>) {
    const DEPTH: u32 = 65_536;
    const N: usize = 4096;
    const SLOTS: usize = 16;
    let mut p = pairs(s, DEPTH, &[patient()]);
    match s.role {
        Role::A => {
            let mr = mr_all::<P>(&p.pd, SLOTS * BUF);
            let srq = p.srq.as_mut().expect("A has the SRQ");
            // Warm-up: the first receives and messages map what every later one uses too.
            for slot in 0..SLOTS {
                post_srq(srq, &mr, slot);
            }
            s.send(b"warm");
            for _ in 0..SLOTS {
                assert_eq!(poll_n(&mut p.cq, 1)[0].status, WcStatus::Success);
            }
            s.barrier();
            let before = thread_faults();
            for i in 0..N {
                post_srq(srq, &mr, i % SLOTS);
            }
            let faults = thread_faults() - before;
            s.send(b"posted");
            for _ in 0..N {
                assert_eq!(poll_n(&mut p.cq, 1)[0].status, WcStatus::Success);
            }
            s.barrier();
            assert!(
                faults <= 4,
                "posting {N} receives took {faults} page faults"
            );
        }
        Role::B => {
            let mr = mr_all::<P>(&p.pd, BUF);
            let qp = &mut p.qps[0];
            assert_eq!(s.recv(), b"warm");
            let mut send = |n: usize, cq: &mut P::Cq| {
                for k in 0..n / 8 {
                    for j in 0..8 {
                        let id = (k * 8 + j) as u64;
                        post_send(qp, id, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
                    }
                    for _ in 0..8 {
                        assert_eq!(poll_n(cq, 1)[0].status, WcStatus::Success);
                    }
                }
            };
            send(SLOTS, &mut p.cq);
            s.barrier();
            assert_eq!(s.recv(), b"posted");
            let before = thread_faults();
            send(N, &mut p.cq);
            let faults = thread_faults() - before;
            s.barrier();
            assert!(
                faults <= 4,
                "{N} SENDs into the SRQ took {faults} page faults"
            );
        }
    }
}
