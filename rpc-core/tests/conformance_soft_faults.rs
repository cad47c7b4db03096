//! Soft-provider specifics beyond the generic suite: byte counters (one copy per payload
//! byte), the fault-injection hooks, garbage in shared rings, stale endpoints, teardown in any
//! order, and atomics on memory that is not shared.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod conformance;

use std::time::{Duration, Instant};

use conformance::harness::{
    self, Mode, Opts, Role, Side, assert_ok, connect, mr_all, poll_for, poll_n, post_recv,
    post_send, write_mr,
};
use rpc_core::verbs::soft::{Soft, SoftContext, SoftCq, SoftQp, fault, vendor};
use rpc_core::verbs::{
    Access, CompChannel, ConnectAttr, Context, Cq, Endpoint, ErrorKind, Mr, Pd, Provider, Qp,
    QpCaps, QpState, RecvWr, SendFlags, SendWr, Sge, Srq, SrqCaps, Wc, WcStatus, WrOp,
};

const SIG: SendFlags = SendFlags::SIGNALED;

/// Moves `a` and `b` to INIT and connects them to each other with `attr`.
fn join(a: &mut SoftQp, b: &mut SoftQp, attr: &ConnectAttr) {
    a.modify_to_init(attr.access).unwrap();
    b.modify_to_init(attr.access).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb, attr).unwrap();
    b.connect(&ea, attr).unwrap();
}

/// Two connected QPs in two contexts of this process, driven from one thread.
struct Pair {
    a_ctx: SoftContext,
    b_ctx: SoftContext,
    a_pd: <Soft as Provider>::Pd,
    b_pd: <Soft as Provider>::Pd,
    a_cq: SoftCq,
    b_cq: SoftCq,
    a: SoftQp,
    b: SoftQp,
}

fn pair_with(attr: ConnectAttr, b_channel: Option<&<Soft as Provider>::CompChannel>) -> Pair {
    let a_ctx = Soft::open(None).unwrap();
    let b_ctx = Soft::open(None).unwrap();
    pair_in(a_ctx, b_ctx, attr, None, b_channel)
}

fn pair_in(
    a_ctx: SoftContext,
    b_ctx: SoftContext,
    attr: ConnectAttr,
    a_channel: Option<&<Soft as Provider>::CompChannel>,
    b_channel: Option<&<Soft as Provider>::CompChannel>,
) -> Pair {
    let a_pd = a_ctx.alloc_pd().unwrap();
    let b_pd = b_ctx.alloc_pd().unwrap();
    let a_cq = a_ctx.create_cq(256, a_channel).unwrap();
    let b_cq = b_ctx.create_cq(256, b_channel).unwrap();
    let caps = Opts::default().caps;
    let mut a = a_pd.create_qp(&a_cq, &a_cq, caps).unwrap();
    let mut b = b_pd.create_qp(&b_cq, &b_cq, caps).unwrap();
    join(&mut a, &mut b, &attr);
    Pair {
        a_ctx,
        b_ctx,
        a_pd,
        b_pd,
        a_cq,
        b_cq,
        a,
        b,
    }
}

fn pair() -> Pair {
    pair_with(ConnectAttr::default(), None)
}

#[test]
fn counters_one_copy_per_payload_byte() {
    let mut p = pair();
    let src = mr_all::<Soft>(&p.a_pd, 1 << 20);
    let dst = mr_all::<Soft>(&p.b_pd, 1 << 20);
    let r = dst.remote();
    let before = p.a_ctx.counters();
    const N: u32 = 777_777;
    let w = WrOp::Write {
        remote_addr: r.addr,
        rkey: r.rkey,
    };
    post_send(&mut p.a, 1, w, &[src.sge(0, N).unwrap()], SIG);
    assert_ok(&poll_n(&mut p.a_cq, 1)[0], 1);
    let after = p.a_ctx.counters();
    assert_eq!(
        after.bytes_copied - before.bytes_copied,
        u64::from(N),
        "WRITE"
    );
    assert_eq!(after.ops - before.ops, 1);
    // The responder copied nothing: its CPU is not involved.
    assert_eq!(p.b_ctx.counters().bytes_copied, 0);

    let rd = WrOp::Read {
        remote_addr: r.addr,
        rkey: r.rkey,
    };
    post_send(&mut p.a, 2, rd, &[src.sge(0, 1000).unwrap()], SIG);
    assert_ok(&poll_n(&mut p.a_cq, 1)[0], 2);
    post_recv(&mut p.b, 3, &[dst.sge(0, 4096).unwrap()]);
    post_send(&mut p.a, 4, WrOp::Send, &[src.sge(0, 3000).unwrap()], SIG);
    assert_ok(&poll_n(&mut p.a_cq, 1)[0], 4);
    assert_ok(&poll_n(&mut p.b_cq, 1)[0], 3);
    let end = p.a_ctx.counters();
    assert_eq!(end.bytes_copied - after.bytes_copied, 1000 + 3000);
    assert_eq!(end.ops - after.ops, 2);
}

#[test]
fn rnr_retries_are_counted_and_bounded() {
    let attr = ConnectAttr {
        rnr_retry: 3,
        min_rnr_timer: 1, // 10 µs
        ..ConnectAttr::default()
    };
    let mut p = pair_with(attr, None);
    let mr = mr_all::<Soft>(&p.a_pd, 64);
    post_send(&mut p.a, 1, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
    let wc = poll_n(&mut p.a_cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RnrRetryExcErr);
    assert_eq!(wc.vendor_err, vendor::RNR);
    // The first attempt and three retries each met an empty receive queue.
    assert_eq!(p.a_ctx.counters().rnr_retries, 4);
}

#[test]
fn responder_error_fails_both_qps() {
    let mut p = pair();
    let mr = mr_all::<Soft>(&p.a_pd, 4096);
    let rmr = mr_all::<Soft>(&p.b_pd, 64);
    post_recv(&mut p.b, 10, &[rmr.sge(0, 16).unwrap()]);
    post_recv(&mut p.b, 11, &[rmr.sge(16, 16).unwrap()]);
    // 100 bytes into a 16-byte receive: LOC_LEN_ERR there, REM_INV_REQ_ERR here.
    post_send(&mut p.a, 1, WrOp::Send, &[mr.sge(0, 100).unwrap()], SIG);
    let wc = poll_n(&mut p.a_cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RemInvReqErr);
    assert_eq!(wc.vendor_err, vendor::RECV_TOO_SMALL);
    let wcs = poll_n(&mut p.b_cq, 2);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (10, WcStatus::LocLenErr));
    assert_eq!((wcs[1].wr_id, wcs[1].status), (11, WcStatus::WrFlushErr));
    assert_eq!(p.a.state(), QpState::Error);
    assert_eq!(p.b.state(), QpState::Error);
}

#[test]
fn fault_force_error_flushes_everything() {
    let mut p = pair();
    let mr = mr_all::<Soft>(&p.a_pd, 4096);
    post_recv(&mut p.a, 1, &[mr.sge(0, 64).unwrap()]);
    post_recv(&mut p.a, 2, &[mr.sge(64, 64).unwrap()]);
    fault::force_error(&p.a);
    assert_eq!(p.a.state(), QpState::Error);
    post_send(
        &mut p.a,
        3,
        WrOp::Send,
        &[mr.sge(0, 8).unwrap()],
        SendFlags::NONE,
    );
    let mut wcs = poll_n(&mut p.a_cq, 3);
    wcs.sort_by_key(|w| w.wr_id);
    assert!(
        wcs.iter().all(|w| w.status == WcStatus::WrFlushErr),
        "{wcs:?}"
    );
    assert_eq!(wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(), [1, 2, 3]);
}

#[test]
fn fault_delay_completions() {
    let mut p = pair();
    let src = mr_all::<Soft>(&p.a_pd, 64);
    let dst = mr_all::<Soft>(&p.b_pd, 64);
    let r = dst.remote();
    fault::delay_completions(&p.a, Duration::from_millis(30));
    let t0 = Instant::now();
    let w = WrOp::Write {
        remote_addr: r.addr,
        rkey: r.rkey,
    };
    post_send(&mut p.a, 1, w, &[src.sge(0, 8).unwrap()], SIG);
    post_send(&mut p.a, 2, w, &[src.sge(0, 8).unwrap()], SIG);
    let wcs = poll_n(&mut p.a_cq, 2);
    assert!(
        t0.elapsed() >= Duration::from_millis(30),
        "{:?}",
        t0.elapsed()
    );
    assert_ok(&wcs[0], 1);
    assert_ok(&wcs[1], 2);
    fault::delay_completions(&p.a, Duration::ZERO);
}

#[test]
fn fault_peer_death_fails_queued_work_and_wakes_sleepers() {
    let a_ctx = Soft::open(None).unwrap();
    let b_ctx = Soft::open(None).unwrap();
    let ch = a_ctx.create_comp_channel().unwrap();
    let attr = ConnectAttr {
        rnr_retry: 7,
        min_rnr_timer: 0, // 655 ms between retries
        ..ConnectAttr::default()
    };
    let mut p = pair_in(a_ctx, b_ctx, attr, Some(&ch), None);
    let mr = mr_all::<Soft>(&p.a_pd, 64);
    // B posts nothing: the SEND is queued for RNR retries.
    post_send(&mut p.a, 1, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
    assert!(poll_for(&mut p.a_cq, Duration::from_millis(5)).is_empty());
    p.a_cq.req_notify(false).unwrap();
    let t0 = Instant::now();
    std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(20));
            assert!(fault::fake_peer_death(&p.a));
        });
        // Wakes on the death (the next RNR retry is 650 ms away).
        assert!(ch.wait(Some(Duration::from_secs(5))).unwrap());
    });
    assert!(
        t0.elapsed() < Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );
    let wc = poll_n(&mut p.a_cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RetryExcErr);
    assert_eq!(wc.vendor_err, vendor::PEER_DEAD);
    assert_eq!(p.a.state(), QpState::Error);
}

#[test]
fn channel_wait_wakes_for_rnr_retry() {
    let a_ctx = Soft::open(None).unwrap();
    let b_ctx = Soft::open(None).unwrap();
    let ch = a_ctx.create_comp_channel().unwrap();
    let attr = ConnectAttr {
        rnr_retry: 7,
        min_rnr_timer: 14, // 1.28 ms
        ..ConnectAttr::default()
    };
    let mut p = pair_in(a_ctx, b_ctx, attr, Some(&ch), None);
    let mr = mr_all::<Soft>(&p.a_pd, 64);
    let rmr = mr_all::<Soft>(&p.b_pd, 64);
    post_send(&mut p.a, 1, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
    post_recv(&mut p.b, 2, &[rmr.sge(0, 64).unwrap()]);
    // The retry is due within ~1.3 ms: a long wait must return early so that poll drives it.
    let t0 = Instant::now();
    let mut got = 0;
    let mut wc = [Wc::default(); 1];
    while got == 0 {
        p.a_cq.req_notify(false).unwrap();
        got = p.a_cq.poll(&mut wc).unwrap();
        if got == 0 {
            ch.wait(Some(Duration::from_secs(10))).unwrap();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "slept past the retry"
        );
    }
    assert_ok(&wc[0], 1);
}

#[test]
fn channel_fd_becomes_readable_when_a_retry_is_due() {
    use std::os::fd::AsRawFd;
    let a_ctx = Soft::open(None).unwrap();
    let b_ctx = Soft::open(None).unwrap();
    let ch = a_ctx.create_comp_channel().unwrap();
    let attr = ConnectAttr {
        rnr_retry: 7,
        min_rnr_timer: 16, // 2.56 ms
        ..ConnectAttr::default()
    };
    let mut p = pair_in(a_ctx, b_ctx, attr, Some(&ch), None);
    let mr = mr_all::<Soft>(&p.a_pd, 64);
    let rmr = mr_all::<Soft>(&p.b_pd, 64);
    post_send(&mut p.a, 1, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
    post_recv(&mut p.b, 2, &[rmr.sge(0, 64).unwrap()]);
    // Sleep on the descriptor only (as epoll / tokio AsyncFd would), never in `wait`.
    let t0 = Instant::now();
    let mut wc = [Wc::default(); 1];
    let mut wakeups = 0;
    loop {
        p.a_cq.req_notify(false).unwrap();
        if p.a_cq.poll(&mut wc).unwrap() == 1 {
            break;
        }
        let mut pfd = libc::pollfd {
            fd: ch.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, 5000) };
        assert_eq!(
            r, 1,
            "the descriptor did not become readable when the retry was due"
        );
        ch.drain().unwrap();
        wakeups += 1;
        assert!(
            t0.elapsed() < Duration::from_secs(2),
            "slept past the retry"
        );
    }
    assert_ok(&wc[0], 1);
    assert!(wakeups <= 10, "{wakeups} wake-ups for one retry");
}

#[test]
fn garbage_receive_completion_is_an_error_not_ub() {
    let mut p = pair();
    let mr = mr_all::<Soft>(&p.b_pd, 64);
    post_recv(&mut p.b, 1, &[mr.sge(0, 64).unwrap()]);
    post_recv(&mut p.b, 2, &[mr.sge(0, 64).unwrap()]);
    assert!(fault::corrupt_recv_completion(&p.b));
    let wcs = poll_n(&mut p.b_cq, 2);
    assert_eq!(wcs[0].wr_id, 1);
    assert_eq!(wcs[0].status, WcStatus::GeneralErr);
    assert_eq!(wcs[0].vendor_err, vendor::CORRUPT);
    assert_eq!(wcs[1].status, WcStatus::WrFlushErr);
    assert_eq!(p.b.state(), QpState::Error);
}

#[test]
fn garbage_posted_receive_fails_the_sender_cleanly() {
    let mut p = pair();
    let src = mr_all::<Soft>(&p.a_pd, 64);
    let mr = mr_all::<Soft>(&p.b_pd, 64);
    post_recv(&mut p.b, 1, &[mr.sge(0, 64).unwrap()]);
    assert!(fault::corrupt_posted_recv(&p.b));
    post_send(&mut p.a, 9, WrOp::Send, &[src.sge(0, 8).unwrap()], SIG);
    let wc = poll_n(&mut p.a_cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RemOpErr);
    assert_eq!(wc.vendor_err, vendor::BAD_RECV);
    let rwc = poll_n(&mut p.b_cq, 1)[0];
    assert_eq!(rwc.wr_id, 1);
    assert_ne!(rwc.status, WcStatus::Success);
    assert_eq!(p.a.state(), QpState::Error);
    assert_eq!(p.b.state(), QpState::Error);
}

#[test]
fn garbage_ready_bitmap_is_ignored() {
    let mut p = pair();
    fault::corrupt_ready_bitmap(&p.a_cq);
    let mut wc = [Wc::default(); 8];
    assert_eq!(p.a_cq.poll(&mut wc).unwrap(), 0);
    // Still works afterwards.
    let src = mr_all::<Soft>(&p.a_pd, 64);
    let dst = mr_all::<Soft>(&p.b_pd, 64);
    post_recv(&mut p.b, 1, &[dst.sge(0, 64).unwrap()]);
    post_send(&mut p.a, 2, WrOp::Send, &[src.sge(0, 8).unwrap()], SIG);
    assert_ok(&poll_n(&mut p.a_cq, 1)[0], 2);
    assert_ok(&poll_n(&mut p.b_cq, 1)[0], 1);
}

#[test]
fn stale_and_dead_endpoints_are_refused() {
    let ctx = Soft::open(None).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256, None).unwrap();
    let caps = Opts::default().caps;
    let gone = pd.create_qp(&cq, &cq, caps).unwrap();
    let stale = gone.endpoint();
    drop(gone);
    let mut qp = pd.create_qp(&cq, &cq, caps).unwrap();
    qp.modify_to_init(Access::ALL).unwrap();
    let attr = ConnectAttr::default();
    let e = qp.modify_to_rtr(&stale, &attr).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidEndpoint, "{e}");
    assert!(e.detail().contains("destroyed"), "{e}");

    // An endpoint of a process that exited.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let mut dead = qp.endpoint();
    dead.gid[0..4].copy_from_slice(&pid.to_le_bytes());
    let e = qp.modify_to_rtr(&dead, &attr).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidEndpoint, "{e}");

    let ep = qp.endpoint();
    assert_eq!(ep.provider, Endpoint::PROVIDER_SOFT);
    assert_eq!(Endpoint::from_bytes(&ep.to_bytes()).unwrap(), ep);
    assert_eq!(qp.state(), QpState::Init);
}

#[test]
fn post_time_checks() {
    let mut p = pair();
    let mr = mr_all::<Soft>(&p.a_pd, 4096);
    let sges: Vec<Sge> = (0..5).map(|i| mr.sge(i * 8, 8).unwrap()).collect();
    let try_post = |qp: &mut SoftQp, op: WrOp, sg: &[Sge], flags| {
        let wr = SendWr {
            wr_id: 1,
            op,
            sg_list: sg,
            flags,
        };
        // SAFETY: refused before anything executes.
        unsafe { qp.post_send(&[wr]) }.unwrap_err().error.kind()
    };
    assert_eq!(
        try_post(&mut p.a, WrOp::Send, &sges, SIG),
        ErrorKind::InvalidArgument,
        "more SGEs than max_send_sge"
    );
    let big = [mr.sge(0, 65).unwrap()];
    assert_eq!(
        try_post(&mut p.a, WrOp::Send, &big, SIG | SendFlags::INLINE),
        ErrorKind::InvalidArgument,
        "inline over max_inline_data"
    );
    let r = mr.remote();
    let faa = WrOp::FetchAdd {
        remote_addr: r.addr + 4,
        rkey: r.rkey,
        add: 1,
    };
    assert_eq!(
        try_post(&mut p.a, faa, &sges[..1], SIG),
        ErrorKind::InvalidArgument,
        "unaligned atomic"
    );
    let too_many_recv: Vec<Sge> = (0..5).map(|i| mr.sge(i * 8, 8).unwrap()).collect();
    let rwr = RecvWr {
        wr_id: 1,
        sg_list: &too_many_recv,
    };
    // SAFETY: refused.
    let e = unsafe { p.a.post_recv(&[rwr]) }.unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::InvalidArgument);
    // Caps are enforced at creation.
    let caps = QpCaps {
        max_inline_data: 10_000,
        ..Opts::default().caps
    };
    let e = p.a_pd.create_qp(&p.a_cq, &p.a_cq, caps).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ExceedsCaps);
}

#[test]
fn teardown_in_any_order() {
    for order in 0..4 {
        let mut p = pair();
        let mr = mr_all::<Soft>(&p.a_pd, 64);
        let dst = mr_all::<Soft>(&p.b_pd, 64);
        post_recv(&mut p.b, 1, &[dst.sge(0, 64).unwrap()]);
        post_send(&mut p.a, 2, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
        let Pair {
            a_ctx,
            b_ctx,
            a_pd,
            b_pd,
            a_cq,
            b_cq,
            a,
            b,
        } = p;
        match order {
            0 => drop((a_cq, b_cq, a_ctx, b_ctx, mr, dst, a_pd, b_pd, a, b)),
            1 => drop((b, b_cq, b_pd, dst, b_ctx, a, a_cq, mr, a_pd, a_ctx)),
            2 => drop((a_ctx, b_ctx, a_pd, b_pd, mr, dst, a, b, a_cq, b_cq)),
            _ => drop((dst, mr, a, a_cq, b, b_cq, a_pd, b_pd, a_ctx, b_ctx)),
        }
    }
}

#[test]
fn destroyed_peer_qp_gives_retry_exceeded() {
    let mut p = pair();
    let mr = mr_all::<Soft>(&p.a_pd, 64);
    let dst = mr_all::<Soft>(&p.b_pd, 64);
    let r = dst.remote();
    drop(p.b);
    let w = WrOp::Write {
        remote_addr: r.addr,
        rkey: r.rkey,
    };
    post_send(&mut p.a, 1, w, &[mr.sge(0, 8).unwrap()], SIG);
    let wc = poll_n(&mut p.a_cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RetryExcErr);
    assert_eq!(wc.vendor_err, vendor::PEER_QP_GONE);
}

#[test]
fn reset_and_reconnect() {
    let mut p = pair();
    let mr = mr_all::<Soft>(&p.a_pd, 64);
    let dst = mr_all::<Soft>(&p.b_pd, 64);
    post_recv(&mut p.b, 1, &[dst.sge(0, 64).unwrap()]);
    p.a.modify_to_reset().unwrap();
    p.b.modify_to_reset().unwrap();
    assert_eq!(p.a.state(), QpState::Reset);
    // Reset discards without completions.
    assert!(poll_for(&mut p.b_cq, Duration::from_millis(5)).is_empty());
    let attr = ConnectAttr::default();
    join(&mut p.a, &mut p.b, &attr);
    post_recv(&mut p.b, 2, &[dst.sge(0, 64).unwrap()]);
    write_mr(&mr, 0, b"again!!!");
    post_send(&mut p.a, 3, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
    assert_ok(&poll_n(&mut p.a_cq, 1)[0], 3);
    assert_ok(&poll_n(&mut p.b_cq, 1)[0], 2);
}

#[test]
fn loopback_in_one_context() {
    let ctx = Soft::open(None).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(256, None).unwrap();
    let caps = Opts::default().caps;
    let attr = ConnectAttr::default();
    let mut x = pd.create_qp(&cq, &cq, caps).unwrap();
    let mut y = pd.create_qp(&cq, &cq, caps).unwrap();
    join(&mut x, &mut y, &attr);
    let mr = mr_all::<Soft>(&pd, 128);
    write_mr(&mr, 0, b"loopback");
    post_recv(&mut y, 1, &[mr.sge(64, 64).unwrap()]);
    post_send(&mut x, 2, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
    let mut wcs = poll_n(&mut cq, 2);
    wcs.sort_by_key(|w| w.wr_id);
    assert_ok(&wcs[0], 1);
    assert_eq!(wcs[0].qp_num, y.qp_num());
    assert_ok(&wcs[1], 2);
    assert_eq!(harness::read_mr(&mr, 64, 8), b"loopback");
}

/// Atomics on memory registered with `reg_mr` in another process cannot be atomic with
/// respect to its owner: REM_OP_ERR with a vendor error that says why.
fn atomic_on_user_memory(s: &mut Side<Soft>) {
    let mut c = connect(s, Opts::default());
    match s.role {
        Role::A => {
            let r = s.recv_mr();
            let res = mr_all::<Soft>(&c.pd, 8);
            let faa = WrOp::FetchAdd {
                remote_addr: r.addr,
                rkey: r.rkey,
                add: 1,
            };
            post_send(&mut c.qp, 1, faa, &[res.sge(0, 8).unwrap()], SIG);
            let wc = poll_n(&mut c.cq, 1)[0];
            if s.mode == Mode::Processes {
                assert_eq!(wc.status, WcStatus::RemOpErr, "{wc:?}");
                assert_eq!(wc.vendor_err, vendor::ATOMIC_NOT_SHARED);
            } else {
                assert_ok(&wc, 1); // same process: the word is reachable directly
            }
            s.barrier();
        }
        Role::B => {
            let mut word = Box::new(0u64);
            // SAFETY: `word` outlives the region (dropped after it, below).
            let umr = unsafe { c.pd.reg_mr((&raw mut *word).cast(), 8, Access::ALL) }.unwrap();
            s.send_mr(&umr.remote());
            s.barrier();
            drop(umr);
            drop(word);
        }
    }
}

#[test]
fn atomic_on_user_memory_threads() {
    harness::run::<Soft>(
        Mode::Threads,
        module_path!(),
        "atomic_on_user_memory_threads",
        atomic_on_user_memory,
    );
}

#[test]
fn atomic_on_user_memory_procs() {
    harness::run::<Soft>(
        Mode::Processes,
        module_path!(),
        "atomic_on_user_memory_procs",
        atomic_on_user_memory,
    );
}

#[test]
fn deregistration_is_seen_by_the_peer() {
    let mut p = pair();
    let src = mr_all::<Soft>(&p.a_pd, 64);
    let mut buf = vec![0u8; 4096];
    // SAFETY: `buf` outlives the region.
    let umr = unsafe { p.b_pd.reg_mr(buf.as_mut_ptr(), buf.len(), Access::ALL) }.unwrap();
    let r = umr.remote();
    let w = WrOp::Write {
        remote_addr: r.addr,
        rkey: r.rkey,
    };
    write_mr(&src, 0, b"12345678");
    post_send(&mut p.a, 1, w, &[src.sge(0, 8).unwrap()], SIG);
    assert_ok(&poll_n(&mut p.a_cq, 1)[0], 1);
    drop(umr);
    assert_eq!(&buf[..8], b"12345678");
    buf[..8].fill(0);
    post_send(&mut p.a, 2, w, &[src.sge(0, 8).unwrap()], SIG);
    let wc = poll_n(&mut p.a_cq, 1)[0];
    assert_eq!(wc.status, WcStatus::RemAccessErr);
    assert_eq!(wc.vendor_err, vendor::BAD_KEY);
    assert!(buf.iter().all(|&b| b == 0), "written after deregistration");
}

#[test]
fn queue_full_on_unsignaled_without_completion() {
    let mut p = pair();
    let src = mr_all::<Soft>(&p.a_pd, 64);
    let dst = mr_all::<Soft>(&p.b_pd, 64);
    let r = dst.remote();
    let sge = [src.sge(0, 8).unwrap()];
    let wr = SendWr {
        wr_id: 0,
        op: WrOp::Write {
            remote_addr: r.addr,
            rkey: r.rkey,
        },
        sg_list: &sge,
        flags: SendFlags::NONE,
    };
    let wrs = vec![wr; 100];
    // SAFETY: regions outlive the work.
    let e = unsafe { p.a.post_send(&wrs) }.unwrap_err();
    assert_eq!(e.posted, Opts::default().caps.max_send_wr as usize);
    assert!(e.error.is_queue_full());
    let _ = p.a_ctx.info();
    let _ = p.b_ctx.info();
}

/// Posting on one thread while another polls the send CQ (and so drives RNR retries), against
/// a receiver with a tiny receive queue on a third thread: every message arrives exactly once
/// and in order, every completion is a success.
#[test]
fn concurrent_post_poll_under_rnr() {
    const N: u64 = 20_000;
    let a_ctx = Soft::open(None).unwrap();
    let b_ctx = Soft::open(None).unwrap();
    let attr = ConnectAttr {
        rnr_retry: 7,
        min_rnr_timer: 1, // 10 µs
        ..ConnectAttr::default()
    };
    let (a_pd, b_pd) = (a_ctx.alloc_pd().unwrap(), b_ctx.alloc_pd().unwrap());
    let mut a_cq = a_ctx.create_cq(64, None).unwrap();
    let mut b_cq = b_ctx.create_cq(64, None).unwrap();
    let a_caps = QpCaps {
        max_send_wr: 32,
        max_recv_wr: 1,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 8,
    };
    let b_caps = QpCaps {
        max_send_wr: 1,
        max_recv_wr: 4,
        ..a_caps
    };
    let mut a = a_pd.create_qp(&a_cq, &a_cq, a_caps).unwrap();
    let mut b = b_pd.create_qp(&b_cq, &b_cq, b_caps).unwrap();
    join(&mut a, &mut b, &attr);
    let rbuf = mr_all::<Soft>(&b_pd, 4 * 8);
    let deadline = Instant::now() + Duration::from_secs(60);
    std::thread::scope(|sc| {
        // Poster (returns the QP: destroying it would flush what is still queued).
        let poster = sc.spawn(move || {
            for i in 0..N {
                let v = i.to_le_bytes();
                let sge = [Sge {
                    addr: v.as_ptr() as u64,
                    length: 8,
                    lkey: 0,
                }];
                let flags = if i % 8 == 7 || i == N - 1 {
                    SIG | SendFlags::INLINE
                } else {
                    SendFlags::INLINE
                };
                let wr = SendWr {
                    wr_id: i,
                    op: WrOp::Send,
                    sg_list: &sge,
                    flags,
                };
                loop {
                    // SAFETY: inline: the payload is copied at post time.
                    match unsafe { a.post_send(&[wr]) } {
                        Ok(()) => break,
                        Err(e) if e.error.is_queue_full() => std::thread::yield_now(),
                        Err(e) => panic!("post_send: {e}"),
                    }
                    assert!(Instant::now() < deadline, "poster stuck");
                }
            }
            a
        });
        // Send-side poller: drives the retries, checks the completions.
        let sender_poller = sc.spawn(move || {
            let mut wcs = [Wc::default(); 16];
            let mut last = None;
            while last != Some(N - 1) {
                let n = a_cq.poll(&mut wcs).unwrap();
                for wc in &wcs[..n] {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    assert!(last.is_none_or(|l| wc.wr_id > l), "out of order: {wc:?}");
                    last = Some(wc.wr_id);
                }
                if n == 0 {
                    std::thread::yield_now();
                }
                assert!(
                    Instant::now() < deadline,
                    "send completions stuck at {last:?}"
                );
            }
        });
        // Receiver with four receives.
        let receiver = sc.spawn(move || {
            let mut expect = 0u64;
            for slot in 0..4u64 {
                post_recv(&mut b, slot, &[rbuf.sge(slot as usize * 8, 8).unwrap()]);
            }
            let mut wcs = [Wc::default(); 4];
            while expect < N {
                let n = b_cq.poll(&mut wcs).unwrap();
                for wc in &wcs[..n] {
                    assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
                    let slot = wc.wr_id as usize;
                    let got = u64::from_le_bytes(
                        harness::read_mr(&rbuf, slot * 8, 8).try_into().unwrap(),
                    );
                    assert_eq!(got, expect, "lost, duplicated or reordered message");
                    expect += 1;
                    post_recv(&mut b, wc.wr_id, &[rbuf.sge(slot * 8, 8).unwrap()]);
                }
                if n == 0 {
                    std::thread::yield_now();
                }
                assert!(Instant::now() < deadline, "receiver stuck at {expect}");
            }
        });
        let qp = poster.join().unwrap();
        // Keep the QP until the others are done.
        sender_poller.join().unwrap();
        receiver.join().unwrap();
        assert_eq!(qp.state(), QpState::Rts);
    });
    assert!(
        a_ctx.counters().rnr_retries > 0,
        "the test did not exercise RNR"
    );
}

/// `post_send` with a list: every request runs (in order), the peer's CQ is rung once for the
/// whole list (not once per request), and unsignaled successes write no send completion.
#[test]
fn a_list_of_sends_rings_the_peer_once() {
    let mut p = pair_with(ConnectAttr::default(), None);
    let src = mr_all::<Soft>(&p.a_pd, 4096);
    let dst = mr_all::<Soft>(&p.b_pd, 4096);
    for i in 0..8u64 {
        post_recv(&mut p.b, 100 + i, &[dst.sge(i as usize * 64, 64).unwrap()]);
    }
    for i in 0..64u8 {
        write_mr(&src, usize::from(i), &[i]);
    }
    let c0 = p.a_ctx.counters();
    // Alone: one ring each; unsignaled: no send completion.
    post_send(
        &mut p.a,
        1,
        WrOp::Send,
        &[src.sge(0, 8).unwrap()],
        SendFlags::NONE,
    );
    post_send(
        &mut p.a,
        2,
        WrOp::Send,
        &[src.sge(8, 8).unwrap()],
        SendFlags::NONE,
    );
    let c1 = p.a_ctx.counters();
    assert_eq!(c1.rings - c0.rings, 2);
    assert_eq!(c1.send_cqes - c0.send_cqes, 0);
    // A list of six, only the last signaled: six requests, one ring, one send completion.
    let sges: Vec<Sge> = (0..6).map(|i| src.sge(16 + i * 8, 8).unwrap()).collect();
    let wrs: Vec<SendWr<'_>> = (0..6)
        .map(|i| SendWr {
            wr_id: 10 + i as u64,
            op: WrOp::Send,
            sg_list: std::slice::from_ref(&sges[i]),
            flags: if i == 5 { SIG } else { SendFlags::NONE },
        })
        .collect();
    // SAFETY: the SGEs lie in `src`, alive until the end of the test.
    unsafe { p.a.post_send(&wrs) }.unwrap();
    let c2 = p.a_ctx.counters();
    assert_eq!(c2.ops - c1.ops, 6);
    assert_eq!(c2.rings - c1.rings, 1);
    assert_eq!(c2.send_cqes - c1.send_cqes, 1);
    assert_ok(&poll_n(&mut p.a_cq, 1)[0], 15);
    // The receiver sees all eight, in order, each with its bytes.
    let wcs = poll_n(&mut p.b_cq, 8);
    for (k, wc) in wcs.iter().enumerate() {
        assert_ok(wc, 100 + k as u64);
        assert_eq!(wc.byte_len, 8);
        let want: Vec<u8> = (k as u8 * 8..k as u8 * 8 + 8).collect();
        assert_eq!(harness::read_mr(&dst, k * 64, 8), want, "message {k}");
    }
}

/// A list that runs out of receives half-way: the requests that found one complete at once
/// (and the peer is rung for them when the list ends), the rest wait for receives (RNR) and go
/// in order once the peer posts them; nothing is lost or duplicated.
/// One signaled SEND per SGE, with work-request ids `first`, `first + 1`, ...
fn signaled_sends(sges: &[Sge], first: u64) -> Vec<SendWr<'_>> {
    sges.iter()
        .enumerate()
        .map(|(i, sge)| SendWr {
            wr_id: first + i as u64,
            op: WrOp::Send,
            sg_list: std::slice::from_ref(sge),
            flags: SIG,
        })
        .collect()
}

#[test]
fn a_list_meeting_rnr_half_way_rings_and_resumes_in_order() {
    let attr = ConnectAttr {
        rnr_retry: 7,     // retry forever
        min_rnr_timer: 1, // 10 µs
        ..ConnectAttr::default()
    };
    let mut p = pair_with(attr, None);
    let src = mr_all::<Soft>(&p.a_pd, 4096);
    let dst = mr_all::<Soft>(&p.b_pd, 4096);
    for i in 0..4u8 {
        write_mr(&src, usize::from(i) * 8, &[i; 8]);
    }
    for i in 0..2u64 {
        post_recv(&mut p.b, 100 + i, &[dst.sge(i as usize * 64, 64).unwrap()]);
    }
    let sges: Vec<Sge> = (0..4).map(|i| src.sge(i * 8, 8).unwrap()).collect();
    let wrs = signaled_sends(&sges, 10);
    // SAFETY: the SGEs lie in `src`, alive until the end of the test.
    unsafe { p.a.post_send(&wrs) }.unwrap();
    let first = poll_n(&mut p.b_cq, 2);
    assert_ok(&first[0], 100);
    assert_ok(&first[1], 101);
    for i in 2..4u64 {
        post_recv(&mut p.b, 100 + i, &[dst.sge(i as usize * 64, 64).unwrap()]);
    }
    // The sender's poll retries the waiting requests.
    let sent = poll_n(&mut p.a_cq, 4);
    for (k, wc) in sent.iter().enumerate() {
        assert_ok(wc, 10 + k as u64);
    }
    let rest = poll_n(&mut p.b_cq, 2);
    assert_ok(&rest[0], 102);
    assert_ok(&rest[1], 103);
    for k in 0..4u8 {
        assert_eq!(
            harness::read_mr(&dst, usize::from(k) * 64, 8),
            vec![k; 8],
            "message {k}"
        );
    }
    assert!(p.a_ctx.counters().rnr_retries > 0);
}

/// A list claims the receives of its SENDs with one compare-exchange; when it stops half-way
/// (a bad local key), the receives it did not fill go back to the receiver's queue: they are
/// neither filled out of order nor lost (a flush of the receiver completes each of them).
#[test]
fn a_list_failing_half_way_gives_back_the_receives_it_claimed() {
    let mut p = pair();
    let src = mr_all::<Soft>(&p.a_pd, 4096);
    let dst = mr_all::<Soft>(&p.b_pd, 4096);
    write_mr(&src, 0, &[7; 8]);
    for i in 0..4u64 {
        post_recv(&mut p.b, 100 + i, &[dst.sge(i as usize * 64, 64).unwrap()]);
    }
    let good = src.sge(0, 8).unwrap();
    let bad = Sge {
        lkey: good.lkey ^ 0x5a5a_0000,
        ..good
    };
    let sges = [good, bad, good, good];
    let wrs = signaled_sends(&sges, 10);
    // SAFETY: the SGEs lie in `src` (the bad one names it with a wrong key), alive until the
    // end of the test.
    let _ = unsafe { p.a.post_send(&wrs) };
    let first = poll_n(&mut p.b_cq, 1);
    assert_ok(&first[0], 100);
    assert_eq!(harness::read_mr(&dst, 0, 8), vec![7; 8]);
    // Nothing else arrived: the bad request failed and stopped the list.
    let mut more = [Wc::default(); 4];
    assert_eq!(p.b_cq.poll(&mut more).unwrap(), 0);
    fault::force_error(&p.b);
    let rest = poll_n(&mut p.b_cq, 3);
    for (k, wc) in rest.iter().enumerate() {
        assert_eq!(
            (wc.wr_id, wc.status),
            (101 + k as u64, WcStatus::WrFlushErr),
            "{rest:?}"
        );
    }
}

/// How long `delay_read_responses` holds a READ in the FENCE cases below.
const READ_DELAY: Duration = Duration::from_millis(50);

fn read_then_send_hazard(s: &mut Side<Soft>) {
    let slow = |qp: &mut SoftQp| fault::delay_read_responses(qp, READ_DELAY);
    if let Some(got) = conformance::edges::read_then_send(s, false, slow) {
        assert!(
            got.iter().all(|&b| b == 0),
            "the unfenced SEND waited for the slow READ: the hazard did not show"
        );
    }
}

fn read_then_send_fence_waits(s: &mut Side<Soft>) {
    let slow = |qp: &mut SoftQp| fault::delay_read_responses(qp, READ_DELAY);
    let t0 = Instant::now();
    conformance::edges::read_then_send(s, true, slow);
    if s.role == Role::A {
        assert!(t0.elapsed() >= READ_DELAY, "the READ was not delayed");
    }
}

/// With a slow responder (`delay_read_responses`), an unfenced SEND after a READ of the
/// buffer it sends goes first and carries the old bytes; completions still come in order.
#[test]
fn fence_hazard_shows_without_fence() {
    harness::run::<Soft>(
        Mode::Threads,
        module_path!(),
        "fence_hazard_shows_without_fence",
        read_then_send_hazard,
    );
}

/// With a slow responder, a FENCEd SEND waits for the READ before it and carries its data.
#[test]
fn fence_makes_the_send_wait_for_the_read() {
    harness::run::<Soft>(
        Mode::Processes,
        module_path!(),
        "fence_makes_the_send_wait_for_the_read",
        read_then_send_fence_waits,
    );
}

const OK: WcStatus = WcStatus::Success;
const FLUSH: WcStatus = WcStatus::WrFlushErr;

/// An SRQ of context A with six receives posted and two QPs on it, each connected to a peer
/// in a context of its own (so that one peer can die alone). Fields drop in this order.
struct SrqPeers {
    /// Per peer: its QP, CQ and an 8-byte source region (fields drop first to last).
    peers: Vec<(SoftQp, SoftCq, <Soft as Provider>::Mr)>,
    _peer_pds: Vec<(<Soft as Provider>::Pd, SoftContext)>,
    mine: Vec<SoftQp>,
    _mr: <Soft as Provider>::Mr,
    srq: <Soft as Provider>::Srq,
    a_cq: SoftCq,
    _a_pd: <Soft as Provider>::Pd,
    _a_ctx: SoftContext,
}

impl SrqPeers {
    fn new() -> SrqPeers {
        let a_ctx = Soft::open(None).unwrap();
        let a_pd = a_ctx.alloc_pd().unwrap();
        let a_cq = a_ctx.create_cq(256, None).unwrap();
        let mut srq = a_pd
            .create_srq(SrqCaps {
                max_wr: 8,
                max_sge: 1,
            })
            .unwrap();
        let caps = QpCaps {
            max_recv_wr: 0,
            ..Opts::default().caps
        };
        let attr = ConnectAttr::default();
        let (mut peers, mut peer_pds, mut mine) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..2 {
            let ctx = Soft::open(None).unwrap();
            let pd = ctx.alloc_pd().unwrap();
            let cq = ctx.create_cq(64, None).unwrap();
            let mut b = pd.create_qp(&cq, &cq, caps).unwrap();
            let mut a = a_pd.create_qp_on_srq(&a_cq, &a_cq, caps, &srq).unwrap();
            join(&mut a, &mut b, &attr);
            let b_mr = mr_all::<Soft>(&pd, 64);
            mine.push(a);
            peers.push((b, cq, b_mr));
            peer_pds.push((pd, ctx));
        }
        let mr = mr_all::<Soft>(&a_pd, 8 * 64);
        for slot in 0..6u64 {
            let sge = mr.sge(slot as usize * 64, 64).unwrap();
            let wr = RecvWr {
                wr_id: slot,
                sg_list: std::slice::from_ref(&sge),
            };
            // SAFETY: the region outlives the SRQ's QPs (dropped after them); read only after
            // completions.
            unsafe { srq.post_recv(std::slice::from_ref(&wr)) }.unwrap();
        }
        SrqPeers {
            peers,
            _peer_pds: peer_pds,
            mine,
            _mr: mr,
            srq,
            a_cq,
            _a_pd: a_pd,
            _a_ctx: a_ctx,
        }
    }

    /// Peer `i` sends `n` messages, all of which complete successfully on its side.
    fn send(&mut self, i: usize, n: usize) {
        let (b, cq, b_mr) = &mut self.peers[i];
        for k in 0..n {
            post_send(b, k as u64, WrOp::Send, &[b_mr.sge(0, 8).unwrap()], SIG);
        }
        for wc in poll_n(cq, n) {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
    }

    /// The peer of our QP `i` claims the next receive and gets as far as `stage` (see
    /// [`fault::claim_srq_recv`]).
    fn claim(&self, i: usize, stage: fault::SrqClaim) {
        assert!(fault::claim_srq_recv(&self.srq, &self.mine[i], stage));
    }

    /// The peer of our QP `i` dies, and the QP moves to ERROR (as the RPC layer's watchdog
    /// handling would leave it).
    fn kill(&self, i: usize) {
        assert!(fault::fake_peer_death(&self.mine[i]));
        fault::force_error(&self.mine[i]);
    }

    /// Polls the next completions of the SRQ's CQ: `(wr_id, status, index of our QP named)`
    /// each.
    fn expect(&mut self, want: &[(u64, WcStatus, usize)]) {
        let wcs = poll_n(&mut self.a_cq, want.len());
        let got: Vec<_> = wcs.iter().map(|w| (w.wr_id, w.status, w.qp_num)).collect();
        let want: Vec<_> = want
            .iter()
            .map(|&(id, st, i)| (id, st, self.mine[i].qp_num()))
            .collect();
        assert_eq!(got, want, "{wcs:?}");
    }

    /// Asserts that no completion arrives for a while (a claim in progress holds the rest).
    fn assert_quiet(&mut self, why: &str) {
        let wcs = poll_for(&mut self.a_cq, Duration::from_millis(20));
        assert!(wcs.is_empty(), "{why}: {wcs:?}");
    }
}

/// A peer that dies holding a claim on a shared receive queue does not wedge it: once the QP
/// the claim names is in ERROR with its peer dead, the receive is flushed naming that QP, and
/// the other QPs' messages behind it arrive; whether the claimer died copying (the claim named
/// in its slot) or right after its compare-and-swap (named by the claim word, then in its slot
/// by the next claimer).
#[test]
fn srq_claim_of_a_dead_peer_is_flushed() {
    let mut t = SrqPeers::new();
    // Receive 0 is claimed by QP 0's peer, which dies copying; QP 1's peer then takes 1 and 2.
    t.claim(0, fault::SrqClaim::Named);
    t.send(1, 2);
    t.assert_quiet("completions behind a claim in progress");
    t.kill(0);
    t.expect(&[(0, FLUSH, 0), (1, OK, 1), (2, OK, 1)]);
    // A claim of QP 0 whose claimer died right after its compare-and-swap is flushed too:
    // the claim after it (receive 4, QP 1's) named it in passing.
    t.claim(0, fault::SrqClaim::Swapped);
    t.send(1, 1);
    t.expect(&[(3, FLUSH, 0), (4, OK, 1)]);
}

/// The hazard a claim named after its compare-and-swap had: a live peer descheduled between
/// claiming a shared receive and naming it, while another peer of the SRQ is dead. Its claim
/// is named by the claim word from the instant it is made, so it is never flushed (its
/// claimer would write into a buffer handed back); the dead peer's claims, the one right
/// before it included, still are.
#[test]
fn srq_claim_in_progress_of_a_live_peer_is_not_flushed() {
    let mut t = SrqPeers::new();
    // Receive 0: QP 0's peer swapped and died. Receive 1: QP 1's peer swapped (naming
    // receive 0 in passing) and is about to name its own claim: the claim word's.
    t.claim(0, fault::SrqClaim::Swapped);
    t.claim(1, fault::SrqClaim::Swapped);
    t.kill(0);
    t.expect(&[(0, FLUSH, 0)]);
    t.assert_quiet("a live peer's claim in progress was flushed");
    // QP 1's peer goes on sending (receive 2: it names receive 1 in its slot on the way);
    // receive 1 still holds the completions behind it, and is still not flushed.
    t.send(1, 1);
    t.assert_quiet("a live peer's named claim in progress was flushed");
    // A dead peer's claim after the live one's is not flushed ahead of it either (in
    // order), and once QP 1's peer dies too, its claim goes and the rest arrive.
    t.claim(0, fault::SrqClaim::Swapped);
    t.assert_quiet("completions overtook a claim in progress");
    t.kill(1);
    t.expect(&[(1, FLUSH, 1), (2, OK, 1), (3, FLUSH, 0)]);
}
