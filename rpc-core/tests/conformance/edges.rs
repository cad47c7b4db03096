//! Edge cases of the verbs semantics: zero lengths, a receive too small, the RDMA READ /
//! SEND hazard and FENCE, attribute ranges, the responder's RNR timer. Same conventions as
//! `cases`: both sides run the function and branch on `s.role`; A is the requester.

use std::time::{Duration, Instant};

use rpc_core::verbs::{
    ConnectAttr, Context, Cq, ErrorKind, Mr, Pd, Provider, Qp, QpState, Sge, WcOpcode, WcStatus,
    WrOp,
};

use super::harness::*;

const SIG: rpc_core::verbs::SendFlags = rpc_core::verbs::SendFlags::SIGNALED;

/// A zero-length operation of kind `op` (built from B's region): it succeeds, moves no byte,
/// and (SEND) consumes a receive with `byte_len` 0.
fn zero_length<P: Provider>(s: &mut Side<P>, op: fn(&rpc_core::verbs::RemoteMr) -> WrOp) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            let r = s.recv_mr();
            let op = op(&r);
            post_send(&mut c.qp, 1, op, &[], SIG);
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 1);
            assert_eq!(wc.opcode, op.wc_opcode(), "{wc:?}");
            assert_eq!(wc.byte_len, 0, "{wc:?}");
            assert_eq!(c.qp.state(), QpState::Rts);
            s.barrier();
        }
        Role::B => {
            write_mr(&mr, 0, &pattern(5, 64));
            post_recv(&mut c.qp, 7, &[mr.sge(0, 64).unwrap()]);
            s.send_mr(&mr.remote());
            s.barrier();
            let wcs = poll_for(&mut c.cq, Duration::from_millis(50));
            if matches!(op(&mr.remote()), WrOp::Send) {
                assert_eq!(wcs.len(), 1, "{wcs:?}");
                assert_ok(&wcs[0], 7);
                assert_eq!(wcs[0].byte_len, 0);
            } else {
                assert!(
                    wcs.is_empty(),
                    "a WRITE or READ consumed a receive: {wcs:?}"
                );
            }
            assert_eq!(read_mr(&mr, 0, 64), pattern(5, 64), "bytes changed");
        }
    }
}

/// A SEND with no SGE at all delivers an empty message.
pub fn zero_length_send<P: Provider>(s: &mut Side<P>) {
    zero_length(s, |_| WrOp::Send);
}

/// An RDMA WRITE of zero bytes succeeds and changes nothing.
pub fn zero_length_write<P: Provider>(s: &mut Side<P>) {
    zero_length(s, |r| WrOp::Write {
        remote_addr: r.addr,
        rkey: r.rkey,
    });
}

/// An RDMA READ of zero bytes succeeds and changes nothing.
pub fn zero_length_read<P: Provider>(s: &mut Side<P>) {
    zero_length(s, |r| WrOp::Read {
        remote_addr: r.addr,
        rkey: r.rkey,
    });
}

/// SGEs of length 0 inside a list are skipped, on the gather side and the scatter side.
pub fn zero_length_sge<P: Provider>(s: &mut Side<P>) {
    scatter_gather(
        s,
        21,
        &[(0, 0, 10), (0, 100, 0), (0, 200, 20)],
        &[(0, 1000, 0), (0, 2000, 64)],
    );
}

/// One SGE of [`scatter_gather`]: region (0 or 1), offset, length.
pub type Piece = (usize, usize, u32);

/// A SEND of pattern bytes gathered from `gather` (A's two regions) into a receive scattered
/// over `scatter` (B's): the receiver gets every byte, in order, and `byte_len` says how many.
pub fn scatter_gather<P: Provider>(s: &mut Side<P>, seed: u8, gather: &[Piece], scatter: &[Piece]) {
    let mut c = connect(s, Opts::default());
    let mrs = [mr_all::<P>(&c.pd, 4096), mr_all::<P>(&c.pd, 4096)];
    let sges = |ps: &[Piece]| -> Vec<Sge> {
        ps.iter()
            .map(|&(m, off, len)| mrs[m].sge(off, len).unwrap())
            .collect()
    };
    let total: usize = gather.iter().map(|p| p.2 as usize).sum();
    let msg = pattern(seed, total);
    let mut at = 0;
    match s.role {
        Role::A => {
            for &(m, off, len) in gather {
                write_mr(&mrs[m], off, &msg[at..at + len as usize]);
                at += len as usize;
            }
            assert_eq!(s.recv(), b"posted");
            post_send(&mut c.qp, 1, WrOp::Send, &sges(gather), SIG);
            assert_ok(&poll_n(&mut c.cq, 1)[0], 1);
        }
        Role::B => {
            post_recv(&mut c.qp, 5, &sges(scatter));
            s.send(b"posted");
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 5);
            assert_eq!(wc.byte_len as usize, total);
            for &(m, off, len) in scatter {
                let n = (len as usize).min(total - at);
                assert_eq!(read_mr(&mrs[m], off, n), &msg[at..at + n]);
                at += n;
            }
        }
    }
    s.barrier();
}

/// A SEND larger than the receive posted for it: `LOC_LEN_ERR` at the receiver,
/// `REM_INV_REQ_ERR` at the sender, both QPs in ERROR.
pub fn recv_too_small<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            assert_eq!(s.recv(), b"posted");
            post_send(&mut c.qp, 1, WrOp::Send, &[mr.sge(0, 100).unwrap()], SIG);
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_eq!((wc.wr_id, wc.status), (1, WcStatus::RemInvReqErr), "{wc:?}");
            assert_eq!(wc.qp_num, c.qp.qp_num());
            assert_state_becomes(&c.qp, QpState::Error, "requester");
            s.barrier();
        }
        Role::B => {
            post_recv(&mut c.qp, 9, &[mr.sge(0, 16).unwrap()]);
            s.send(b"posted");
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_eq!((wc.wr_id, wc.status), (9, WcStatus::LocLenErr), "{wc:?}");
            assert_eq!(wc.opcode, WcOpcode::Recv);
            assert_eq!(wc.qp_num, c.qp.qp_num());
            assert_state_becomes(&c.qp, QpState::Error, "after the error completion");
            s.barrier();
        }
    }
}

/// A READ into a buffer followed by a SEND of that buffer: the SEND depends on the READ.
/// With FENCE the SEND waits for the READ and carries the data read; without it, verbs allows
/// the SEND to gather the buffer first (the old bytes), so only the completions are checked.
/// (The soft provider's `delay_read_responses` fault makes the hazard show: see
/// `conformance_soft_faults`.)
pub(crate) fn read_then_send<P: Provider>(
    s: &mut Side<P>,
    fence: bool,
    hazard: fn(&mut P::Qp),
) -> Option<Vec<u8>> {
    const LEN: usize = 256;
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            let r = s.recv_mr();
            assert_eq!(s.recv(), b"posted");
            hazard(&mut c.qp);
            let rd = WrOp::Read {
                remote_addr: r.addr,
                rkey: r.rkey,
            };
            post_send(&mut c.qp, 1, rd, &[mr.sge(0, LEN as u32).unwrap()], SIG);
            let flags = if fence {
                SIG | rpc_core::verbs::SendFlags::FENCE
            } else {
                SIG
            };
            let send = [mr.sge(0, LEN as u32).unwrap()];
            post_send(&mut c.qp, 2, WrOp::Send, &send, flags);
            let wcs = poll_n(&mut c.cq, 2);
            assert_ok(&wcs[0], 1);
            assert_eq!(wcs[0].opcode, WcOpcode::RdmaRead);
            assert_ok(&wcs[1], 2);
            assert_eq!(read_mr(&mr, 0, LEN), pattern(33, LEN));
            s.barrier();
            None
        }
        Role::B => {
            write_mr(&mr, 0, &pattern(33, LEN));
            post_recv(&mut c.qp, 4, &[mr.sge(1024, LEN as u32).unwrap()]);
            s.send_mr(&mr.remote());
            s.send(b"posted");
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 4);
            assert_eq!(wc.byte_len, LEN as u32);
            let got = read_mr(&mr, 1024, LEN);
            if fence {
                assert_eq!(
                    got,
                    pattern(33, LEN),
                    "the FENCEd SEND went before its READ"
                );
            } else {
                assert!(
                    got == pattern(33, LEN) || got.iter().all(|&b| b == 0),
                    "neither the old nor the new bytes: {got:?}"
                );
            }
            s.barrier();
            Some(got)
        }
    }
}

/// READ then a FENCEd SEND of the buffer read: the SEND carries the data read.
pub fn read_then_send_fenced<P: Provider>(s: &mut Side<P>) {
    read_then_send(s, true, |_| {});
}

/// READ then an unfenced SEND of the buffer read: both complete, in order.
pub fn read_then_send_unfenced<P: Provider>(s: &mut Side<P>) {
    read_then_send(s, false, |_| {});
}

/// Attributes out of their verbs ranges are refused the same way on every provider, and the
/// QP stays where it was (it can still be connected with valid ones).
pub fn connect_attr_ranges<P: Provider>(s: &mut Side<P>) {
    let pd = s.ctx.alloc_pd().unwrap();
    let cq = s.ctx.create_cq(256, None).unwrap();
    let mut qp = pd.create_qp(&cq, &cq, Opts::default().caps).unwrap();
    let ok = ConnectAttr::default();
    qp.modify_to_init(ok.access).unwrap();
    let remote = s.exchange_endpoint(&qp.endpoint());
    let rtr_bad = ConnectAttr {
        min_rnr_timer: 32,
        ..ok
    };
    let e = qp.modify_to_rtr(&remote, &rtr_bad).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    assert_eq!(qp.state(), QpState::Init);
    qp.modify_to_rtr(&remote, &ok).unwrap();
    for bad in [
        ConnectAttr { retry_cnt: 8, ..ok },
        ConnectAttr { rnr_retry: 8, ..ok },
        ConnectAttr { timeout: 32, ..ok },
    ] {
        let e = qp.modify_to_rts(&bad).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad:?}: {e}");
        assert_eq!(qp.state(), QpState::Rtr);
    }
    qp.modify_to_rts(&ok).unwrap();
    assert_eq!(qp.state(), QpState::Rts);
    s.barrier();
}

/// An SGE reaching past the end of its region: `LOC_PROT_ERR`, nothing sent.
pub fn local_protection_bounds<P: Provider>(s: &mut Side<P>) {
    local_protection(s, |mr, _| Sge {
        addr: mr.addr() + 4000,
        length: 200,
        lkey: mr.lkey(),
    });
}

/// An SGE naming a region of another protection domain: `LOC_PROT_ERR`, nothing sent.
pub fn local_protection_pd<P: Provider>(s: &mut Side<P>) {
    local_protection(s, |_, foreign| foreign.sge(0, 16).unwrap());
}

fn local_protection<P: Provider>(s: &mut Side<P>, sge: fn(&P::Mr, &P::Mr) -> Sge) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 4096);
    let other_pd = s.ctx.alloc_pd().unwrap();
    let foreign = mr_all::<P>(&other_pd, 4096);
    match s.role {
        Role::A => {
            assert_eq!(s.recv(), b"posted");
            post_send(&mut c.qp, 1, WrOp::Send, &[sge(&mr, &foreign)], SIG);
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_eq!(wc.status, WcStatus::LocProtErr, "{wc:?}");
            assert_state_becomes(&c.qp, QpState::Error, "after the error completion");
            s.barrier();
        }
        Role::B => {
            post_recv(&mut c.qp, 1, &[mr.sge(0, 1024).unwrap()]);
            s.send(b"posted");
            s.barrier();
            assert_zeroed(&mr, 0, 1024, "the receive");
        }
    }
}

/// Reading the device's asynchronous events never blocks, and a healthy connection raises no
/// fatal one.
pub fn async_events_nonblocking<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 4096);
    if s.role == Role::A {
        let r = s.recv_mr();
        let w = WrOp::Write {
            remote_addr: r.addr,
            rkey: r.rkey,
        };
        post_send(&mut c.qp, 1, w, &[mr.sge(0, 64).unwrap()], SIG);
        assert_ok(&poll_n(&mut c.cq, 1)[0], 1);
    } else {
        s.send_mr(&mr.remote());
    }
    let t0 = Instant::now();
    for _ in 0..100 {
        match s.ctx.poll_async_event().expect("poll_async_event") {
            Some(e) => assert!(!e.is_fatal(), "fatal event on a healthy device: {e:?}"),
            None => break,
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "poll_async_event blocked for {:?}",
        t0.elapsed()
    );
    s.barrier();
}

/// A CQ grows (`ibv_resize_cq`): a QP that did not fit is admitted after the resize, the
/// connected QP keeps working through the grown CQ, and a shrink or a size over the device's
/// limit is refused.
pub fn cq_resize<P: Provider>(s: &mut Side<P>) {
    let o = Opts::default();
    let need = o.caps.max_send_wr + o.caps.max_recv_wr;
    let mut c = connect(s, Opts { cqe: need + 2, ..o });
    let small = rpc_core::verbs::QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let e =
        c.pd.create_qp(&c.cq, &c.cq, small)
            .expect_err("8 more completions do not fit 2 free entries");
    assert_eq!(e.kind(), ErrorKind::ExceedsCaps, "{e}");
    let e = c.cq.resize(need).expect_err("a CQ does not shrink");
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let max = s.ctx.caps().max_cqe;
    let e =
        c.cq.resize(max.saturating_add(1))
            .expect_err("over max_cqe");
    assert_eq!(e.kind(), ErrorKind::ExceedsCaps, "{e}");
    c.cq.resize(need * 2).expect("resize");
    assert!(c.cq.capacity() >= need * 2, "capacity {}", c.cq.capacity());
    let extra =
        c.pd.create_qp(&c.cq, &c.cq, small)
            .expect("a QP fits the grown CQ");
    drop(extra);
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            write_mr(&mr, 0, b"grown");
            assert_eq!(s.recv(), b"posted");
            post_send(&mut c.qp, 1, WrOp::Send, &[mr.sge(0, 5).unwrap()], SIG);
            assert_ok(&poll_n(&mut c.cq, 1)[0], 1);
            s.barrier();
        }
        Role::B => {
            post_recv(&mut c.qp, 2, &[mr.sge(0, 64).unwrap()]);
            s.send(b"posted");
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 2);
            assert_eq!(read_mr(&mr, 0, 5), b"grown");
            s.barrier();
        }
    }
}

/// How long [`read_replayed_after_deregistration`] holds back this host's outgoing packets.
const REPLAY_DELAY: Duration = Duration::from_millis(300);

/// `tc qdisc ... netem delay` on this host's RDMA netdev while alive (the pair VMs'
/// `SOFTROCE_NETDEV`); the previous root qdisc comes back on drop.
struct EgressDelay(String);

impl EgressDelay {
    /// `None` where this cannot run: no `SOFTROCE_NETDEV` (not a pair VM) or no `tc`.
    fn new(d: Duration) -> Option<EgressDelay> {
        let dev = std::env::var("SOFTROCE_NETDEV").ok()?;
        let ms = format!("{}ms", d.as_millis());
        let ok = std::process::Command::new("tc")
            .args([
                "qdisc", "replace", "dev", &dev, "root", "netem", "delay", &ms,
            ])
            .args(["limit", "10000"])
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(EgressDelay(dev))
    }
}

impl Drop for EgressDelay {
    fn drop(&mut self) {
        let _ = std::process::Command::new("tc")
            .args(["qdisc", "del", "dev", &self.0, "root"])
            .status();
    }
}

/// The hazard a striped READ fences against (`rpc-core/src/link/stripe.rs`), shown with the
/// verbs alone across two hosts: A READs B's region while A's outgoing packets are held back
/// by [`REPLAY_DELAY`] (longer than the ACK timeout, so A's NIC sends copies of the READ
/// request before the first one even left); B deregisters the region once the READ has been
/// served. A's READ completes with the right bytes, and the copies still on their way reach
/// B after the key is gone: B's NIC executes each duplicate READ again (RC re-executes
/// duplicate READs), finds no key, NAKs it and moves B's QP to ERROR; A ignores the NAK (its
/// READ completed) and sees no error at all. So a lender may end a READ loan only once no
/// copy of the READ request can still arrive: after a later request of the reader on the
/// *same* QP, which RC orders after every copy.
///
/// Needs two hosts with `tc` (the Soft-RoCE pair: `softroce/pair.sh`); elsewhere it passes
/// with a note.
pub fn read_replayed_after_deregistration<P: Provider>(s: &mut Side<P>) {
    // The control first (B keeps its region: both QPs stay in RTS), then the hazard.
    for deregister in [false, true] {
        if !replayed_read::<P>(s, deregister) {
            return;
        }
    }
}

/// One round of [`read_replayed_after_deregistration`]; false when it skipped.
fn replayed_read<P: Provider>(s: &mut Side<P>, deregister: bool) -> bool {
    const LEN: usize = 64 << 10;
    let mut c = connect(s, Opts::default());
    match s.role {
        Role::A => {
            // Side A decides (side B may not know where it runs) and tells B.
            let delay = (s.mode == Mode::Remote)
                .then(|| EgressDelay::new(REPLAY_DELAY))
                .flatten();
            let Some(delay) = delay else {
                eprintln!("skipping: needs a second host with tc (softroce/pair.sh)");
                s.send(b"skip");
                return false;
            };
            s.send(if deregister { b"dereg" } else { b"keep!" });
            let r = s.recv_mr();
            let mr = mr_all::<P>(&c.pd, LEN);
            let op = WrOp::Read {
                remote_addr: r.addr,
                rkey: r.rkey,
            };
            post_send(&mut c.qp, 1, op, &[mr.sge(0, LEN as u32).unwrap()], SIG);
            // Behind the READ request in this host's queue: B learns it was served.
            s.send(b"posted");
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 1);
            assert_eq!(read_mr(&mr, 0, LEN), pattern(11, LEN), "the READ's bytes");
            assert_eq!(s.recv(), b"served");
            // Every copy sent before the READ completed lands within another delay.
            std::thread::sleep(REPLAY_DELAY * 3);
            drop(delay);
            let late = poll_for(&mut c.cq, Duration::from_millis(100));
            s.send(b"state?");
            let b_state = String::from_utf8_lossy(&s.recv()).into_owned();
            eprintln!(
                "read_replayed_after_deregistration (B deregisters: {deregister}): A's QP \
                 {:?}, completions after the READ {late:?}; B: {b_state}",
                c.qp.state()
            );
            assert!(late.is_empty(), "A saw no error: {late:?}");
            assert_eq!(c.qp.state(), QpState::Rts, "A's QP is untouched");
            let want = if deregister { "Error" } else { "Rts" };
            assert!(
                b_state.starts_with(want),
                "B's QP after the duplicate READs (deregistered: {deregister}): {b_state}"
            );
        }
        Role::B => {
            let deregister = match s.recv().as_slice() {
                b"skip" => return false,
                m => m == b"dereg",
            };
            let region = mr_all::<P>(&c.pd, LEN);
            write_mr(&region, 0, &pattern(11, LEN));
            s.send_mr(&region.remote());
            assert_eq!(s.recv(), b"posted");
            // The READ request came in before the message; let the NIC serve it, then end
            // the loan while A's copies of the request are still on their way.
            std::thread::sleep(Duration::from_millis(30));
            let kept = (!deregister).then_some(region);
            s.send(b"served");
            assert_eq!(s.recv(), b"state?");
            let wcs = poll_for(&mut c.cq, Duration::from_millis(100));
            s.send(format!("{:?}, completions {wcs:?}", c.qp.state()).as_bytes());
            drop(kept);
        }
    }
    true
}
