//! The cases of the conformance suite. Each is a function of one [`Side`]; both sides run the
//! same function and branch on `s.role`. Side A is the requester unless said otherwise.

use std::time::{Duration, Instant};

use rpc_core::verbs::{
    Access, CompChannel, ConnectAttr, Context, Cq, Endpoint, ErrorKind, Mr, Pd, Provider, Qp,
    QpCaps, QpState, RecvWr, RemoteMr, SendFlags, SendWr, Sge, Wc, WcOpcode, WcStatus, WrOp,
};

pub use super::edges::*;
use super::harness::*;
pub use super::srq::*;

const SIG: SendFlags = SendFlags::SIGNALED;

/// SEND and SEND_WITH_IMM: payload, byte_len, imm, opcodes, wr_ids.
pub fn send_recv<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            write_mr(&mr, 0, &pattern(1, 100));
            write_mr(&mr, 1024, &pattern(2, 200));
            assert_eq!(s.recv(), b"posted");
            post_send(&mut c.qp, 1, WrOp::Send, &[mr.sge(0, 100).unwrap()], SIG);
            post_send(
                &mut c.qp,
                2,
                WrOp::SendWithImm { imm: 0xdead_beef },
                &[mr.sge(1024, 200).unwrap()],
                SIG,
            );
            let wcs = poll_n(&mut c.cq, 2);
            assert_ok(&wcs[0], 1);
            assert_eq!(wcs[0].opcode, WcOpcode::Send);
            assert_eq!(wcs[0].qp_num, c.qp.qp_num());
            assert_ok(&wcs[1], 2);
            s.barrier();
        }
        Role::B => {
            post_recv(&mut c.qp, 10, &[mr.sge(0, 512).unwrap()]);
            post_recv(&mut c.qp, 11, &[mr.sge(512, 512).unwrap()]);
            s.send(b"posted");
            let wcs = poll_n(&mut c.cq, 2);
            assert_ok(&wcs[0], 10);
            assert_eq!(wcs[0].opcode, WcOpcode::Recv);
            assert_eq!(wcs[0].byte_len, 100);
            assert_eq!(wcs[0].imm(), None);
            assert_eq!(wcs[0].qp_num, c.qp.qp_num());
            assert_ok(&wcs[1], 11);
            assert_eq!(wcs[1].byte_len, 200);
            assert_eq!(wcs[1].imm(), Some(0xdead_beef));
            assert_eq!(read_mr(&mr, 0, 100), pattern(1, 100));
            assert_eq!(read_mr(&mr, 512, 200), pattern(2, 200));
            s.barrier();
        }
    }
}

/// Gather on the sender (three SGEs from two regions), scatter on the receiver (two SGEs).
pub fn send_sg_list<P: Provider>(s: &mut Side<P>) {
    scatter_gather(
        s,
        7,
        &[(0, 0, 10), (1, 100, 50), (0, 500, 40)],
        &[(0, 0, 30), (1, 1000, 200)],
    );
}

/// INLINE sends come from unregistered memory that may be reused as soon as post returns.
pub fn send_inline<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 4096);
    let msg = pattern(9, 48);
    match s.role {
        Role::A => {
            let mut buf = msg.clone();
            assert_eq!(s.recv(), b"posted");
            let sge = Sge {
                addr: buf.as_ptr() as u64,
                length: buf.len() as u32,
                lkey: 0,
            };
            post_send(
                &mut c.qp,
                1,
                WrOp::SendWithImm { imm: 3 },
                &[sge],
                SIG | SendFlags::INLINE,
            );
            buf.fill(0); // reuse at once: the payload was copied at post time
            assert_ok(&poll_n(&mut c.cq, 1)[0], 1);
            s.barrier();
        }
        Role::B => {
            post_recv(&mut c.qp, 5, &[mr.sge(0, 256).unwrap()]);
            s.send(b"posted");
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 5);
            assert_eq!(wc.byte_len, 48);
            assert_eq!(wc.imm(), Some(3));
            assert_eq!(read_mr(&mr, 0, 48), msg);
            s.barrier();
        }
    }
}

/// WRITE and READ move exactly the addressed bytes while the remote side posts nothing.
pub fn write_read<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 1 << 16);
    match s.role {
        Role::A => {
            let remote = s.recv_mr();
            let data = pattern(3, 5000);
            write_mr(&mr, 0, &data);
            let op = WrOp::Write {
                remote_addr: remote.addr + 1000,
                rkey: remote.rkey,
            };
            post_send(&mut c.qp, 1, op, &[mr.sge(0, 5000).unwrap()], SIG);
            assert_ok(&poll_n(&mut c.cq, 1)[0], 1);
            // Read B's pre-filled range back into another place.
            let op = WrOp::Read {
                remote_addr: remote.addr + 20_000,
                rkey: remote.rkey,
            };
            let sges = [mr.sge(30_000, 100).unwrap(), mr.sge(40_000, 900).unwrap()];
            post_send(&mut c.qp, 2, op, &sges, SIG);
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 2);
            assert_eq!(wc.opcode, WcOpcode::RdmaRead);
            assert_eq!(wc.byte_len, 1000);
            let want = pattern(4, 1000);
            assert_eq!(read_mr(&mr, 30_000, 100), &want[..100]);
            assert_eq!(read_mr(&mr, 40_000, 900), &want[100..]);
            s.barrier();
        }
        Role::B => {
            write_mr(&mr, 20_000, &pattern(4, 1000));
            s.send_mr(&mr.remote());
            s.barrier();
            assert_eq!(read_mr(&mr, 1000, 5000), pattern(3, 5000));
            assert!(
                read_mr(&mr, 0, 1000).iter().all(|&b| b == 0),
                "bytes before"
            );
            assert!(
                read_mr(&mr, 6000, 1000).iter().all(|&b| b == 0),
                "bytes after"
            );
            // B posted nothing and got nothing.
            assert!(poll_for(&mut c.cq, Duration::from_millis(20)).is_empty());
        }
    }
}

/// WRITE_WITH_IMM writes, consumes one receive and delivers the immediate.
pub fn write_with_imm<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 8192);
    match s.role {
        Role::A => {
            let remote = s.recv_mr();
            write_mr(&mr, 0, &pattern(5, 300));
            let op = WrOp::WriteWithImm {
                remote_addr: remote.addr + 4096,
                rkey: remote.rkey,
                imm: 0x1234_5678,
            };
            post_send(&mut c.qp, 1, op, &[mr.sge(0, 300).unwrap()], SIG);
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 1);
            assert_eq!(wc.opcode, WcOpcode::RdmaWrite);
            s.barrier();
        }
        Role::B => {
            post_recv(&mut c.qp, 77, &[mr.sge(0, 16).unwrap()]);
            s.send_mr(&mr.remote());
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 77);
            assert_eq!(wc.opcode, WcOpcode::RecvRdmaWithImm);
            assert_eq!(wc.imm(), Some(0x1234_5678));
            assert_eq!(wc.byte_len, 300);
            assert_eq!(read_mr(&mr, 4096, 300), pattern(5, 300));
            assert!(
                read_mr(&mr, 0, 16).iter().all(|&b| b == 0),
                "receive buffer untouched"
            );
            s.barrier();
        }
    }
}

fn u64_at<M: Mr>(mr: &M, off: usize) -> u64 {
    u64::from_le_bytes(read_mr(mr, off, 8).try_into().unwrap())
}

/// Compare-and-swap and fetch-and-add return the old value and change the word as they should.
pub fn atomics<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 64);
    match s.role {
        Role::A => {
            let r = s.recv_mr();
            let op = |qp: &mut P::Qp, cq: &mut P::Cq, id: u64, op: WrOp| -> u64 {
                post_send(qp, id, op, &[mr.sge(0, 8).unwrap()], SIG);
                let wc = poll_n(cq, 1)[0];
                assert_ok(&wc, id);
                u64_at(&mr, 0)
            };
            let faa = WrOp::FetchAdd {
                remote_addr: r.addr,
                rkey: r.rkey,
                add: 7,
            };
            assert_eq!(op(&mut c.qp, &mut c.cq, 1, faa), 100);
            let cas = |compare, swap| WrOp::CompareSwap {
                remote_addr: r.addr,
                rkey: r.rkey,
                compare,
                swap,
            };
            assert_eq!(op(&mut c.qp, &mut c.cq, 2, cas(107, 1000)), 107);
            // A failing compare returns the current value and changes nothing.
            assert_eq!(op(&mut c.qp, &mut c.cq, 3, cas(1, 2)), 1000);
            let faa8 = WrOp::FetchAdd {
                remote_addr: r.addr + 8,
                rkey: r.rkey,
                add: u64::MAX, // wraps: 5 - 1
            };
            assert_eq!(op(&mut c.qp, &mut c.cq, 4, faa8), 5);
            s.barrier();
        }
        Role::B => {
            write_mr(&mr, 0, &100u64.to_le_bytes());
            write_mr(&mr, 8, &5u64.to_le_bytes());
            s.send_mr(&mr.remote());
            s.barrier();
            assert_eq!(u64_at(&mr, 0), 1000);
            assert_eq!(u64_at(&mr, 8), 4);
        }
    }
}

fn hammer<P: Provider>(
    qp: &mut P::Qp,
    cq: &mut P::Cq,
    result: &P::Mr,
    target: RemoteMr,
    n: usize,
) -> Vec<u64> {
    let mut olds = Vec::with_capacity(n);
    const BATCH: usize = 16;
    let mut done = 0;
    while done < n {
        let k = BATCH.min(n - done);
        let sges: Vec<Sge> = (0..k).map(|i| result.sge(i * 8, 8).unwrap()).collect();
        let wrs: Vec<SendWr<'_>> = (0..k)
            .map(|i| SendWr {
                wr_id: (done + i) as u64,
                op: WrOp::FetchAdd {
                    remote_addr: target.addr,
                    rkey: target.rkey,
                    add: 1,
                },
                sg_list: std::slice::from_ref(&sges[i]),
                flags: SIG,
            })
            .collect();
        // SAFETY: `result` outlives the completions polled below.
        unsafe { qp.post_send(&wrs) }.expect("post FAA batch");
        for wc in poll_n(cq, k) {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        olds.extend((0..k).map(|i| u64_at(result, i * 8)));
        done += k;
    }
    olds
}

/// Two requesters (side A's process and side B's, through a loopback QP pair) hammer one
/// counter with fetch-and-add at the same time: the final value and the set of old values are
/// exact.
pub fn atomics_concurrent<P: Provider>(s: &mut Side<P>) {
    const N: usize = 2000;
    let mut c = connect(s, Opts::default());
    match s.role {
        Role::A => {
            let result = mr_all::<P>(&c.pd, 16 * 8);
            let target = s.recv_mr();
            s.barrier();
            let olds = hammer::<P>(&mut c.qp, &mut c.cq, &result, target, N);
            let bytes: Vec<u8> = olds.iter().flat_map(|v| v.to_le_bytes()).collect();
            s.send(&bytes);
            s.barrier();
        }
        Role::B => {
            let counter = mr_all::<P>(&c.pd, 64);
            let result = mr_all::<P>(&c.pd, 16 * 8);
            // A loopback pair inside B's context.
            let mut lcq = s.ctx.create_cq(256, None).unwrap();
            let caps = Opts::default().caps;
            let mut x = c.pd.create_qp(&lcq, &lcq, caps).unwrap();
            let mut y = c.pd.create_qp(&lcq, &lcq, caps).unwrap();
            let attr = ConnectAttr::default();
            x.modify_to_init(attr.access).unwrap();
            y.modify_to_init(attr.access).unwrap();
            let (ex, ey) = (x.endpoint(), y.endpoint());
            x.connect(&ey, &attr).unwrap();
            y.connect(&ex, &attr).unwrap();
            s.send_mr(&counter.remote());
            s.barrier();
            let mine = hammer::<P>(&mut x, &mut lcq, &result, counter.remote(), N);
            let theirs = s.recv();
            s.barrier();
            assert_eq!(u64_at(&counter, 0), 2 * N as u64, "final counter value");
            let mut all: Vec<u64> = theirs
                .chunks(8)
                .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
                .chain(mine)
                .collect();
            all.sort_unstable();
            assert!(
                all.iter().enumerate().all(|(i, &v)| v == i as u64),
                "old values are not a permutation of 0..2N: not atomic"
            );
        }
    }
}

/// Wrong rkey, out of bounds, missing right, deregistered region, region of another PD: each
/// REM_ACCESS_ERR, and the requester's QP moves to ERROR (the responder's too on soft).
pub fn remote_access_errors<P: Provider>(s: &mut Side<P>) {
    let names = [
        "wrong rkey",
        "out of bounds",
        "missing right",
        "deregistered",
        "other PD",
    ];
    for (k, name) in names.iter().enumerate() {
        let mut c = connect(s, Opts::default());
        match s.role {
            Role::A => {
                let r = s.recv_mr();
                let mr = mr_all::<P>(&c.pd, 4096);
                let (addr, rkey, len) = match k {
                    0 => (r.addr, r.rkey ^ 0x00ab_cd00, 64),
                    1 => (r.addr + r.len - 32, r.rkey, 64),
                    _ => (r.addr, r.rkey, 64),
                };
                let op = WrOp::Write {
                    remote_addr: addr,
                    rkey,
                };
                post_send(&mut c.qp, 9, op, &[mr.sge(0, len).unwrap()], SIG);
                let wc = poll_n(&mut c.cq, 1)[0];
                assert_eq!(wc.status, WcStatus::RemAccessErr, "{name}: {wc:?}");
                assert_eq!(wc.wr_id, 9);
                assert_state_becomes(&c.qp, QpState::Error, &format!("{name}: requester"));
                s.barrier();
            }
            Role::B => {
                let ro =
                    c.pd.alloc_mr(4096, Access::LOCAL_WRITE | Access::REMOTE_READ)
                        .unwrap();
                let other_pd = s.ctx.alloc_pd().unwrap();
                let other = other_pd.alloc_mr(4096, Access::ALL).unwrap();
                let rw = mr_all::<P>(&c.pd, 4096);
                match k {
                    2 => s.send_mr(&ro.remote()),
                    3 => {
                        let dead = mr_all::<P>(&c.pd, 4096);
                        let r = dead.remote();
                        drop(dead);
                        s.send_mr(&r);
                    }
                    4 => s.send_mr(&other.remote()),
                    _ => s.send_mr(&rw.remote()),
                }
                s.barrier();
                if P::NAME == "soft" {
                    // Poll once so the QP notices; soft moves the responder to ERROR as well.
                    let _ = poll_for(&mut c.cq, Duration::from_millis(5));
                    assert_eq!(c.qp.state(), QpState::Error, "{name}: responder QP state");
                }
                assert_zeroed(&rw, 0, 4096, name);
                assert_zeroed(&ro, 0, 4096, name);
            }
        }
    }
}

/// After a failure, everything outstanding and everything posted later completes with
/// WR_FLUSH_ERR, sends and receives, signaled or not.
pub fn flush_after_failure<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            let r = s.recv_mr();
            post_recv(&mut c.qp, 100, &[mr.sge(0, 64).unwrap()]);
            post_recv(&mut c.qp, 101, &[mr.sge(64, 64).unwrap()]);
            let bad = WrOp::Write {
                remote_addr: r.addr,
                rkey: r.rkey.wrapping_add(0x0100_0000),
            };
            post_send(&mut c.qp, 1, bad, &[mr.sge(128, 8).unwrap()], SIG);
            let first = poll_n(&mut c.cq, 1)[0];
            assert_eq!(first.status, WcStatus::RemAccessErr, "{first:?}");
            let good = WrOp::Write {
                remote_addr: r.addr,
                rkey: r.rkey,
            };
            post_send(&mut c.qp, 2, good, &[mr.sge(128, 8).unwrap()], SIG);
            post_send(
                &mut c.qp,
                3,
                WrOp::Send,
                &[mr.sge(128, 8).unwrap()],
                SendFlags::NONE,
            );
            post_recv(&mut c.qp, 102, &[mr.sge(192, 64).unwrap()]);
            let mut wcs = poll_n(&mut c.cq, 5);
            wcs.sort_by_key(|w| w.wr_id);
            let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
            assert_eq!(ids, [2, 3, 100, 101, 102]);
            for w in &wcs {
                assert_eq!(w.status, WcStatus::WrFlushErr, "{w:?}");
            }
            assert!(read_mr(&mr, 0, 128).iter().all(|&b| b == 0));
            s.barrier();
        }
        Role::B => {
            s.send_mr(&mr.remote());
            s.barrier();
            assert!(
                read_mr(&mr, 0, 4096).iter().all(|&b| b == 0),
                "nothing written"
            );
        }
    }
}

fn rnr_attr(rnr_retry: u8) -> Opts {
    let mut o = Opts::default();
    o.attr.rnr_retry = rnr_retry;
    o.attr.min_rnr_timer = 12; // 0.64 ms
    o
}

/// A SEND without a posted receive waits through the RNR retries, then fails with
/// RNR_RETRY_EXC_ERR and moves the QP to ERROR; what was posted behind it is flushed. The
/// retries are paced by the *responder's* `min_rnr_timer` (the RNR NAK carries it), not by
/// the requester's: A asks for 10 µs, B for 10.24 ms.
pub fn rnr_retry_exceeded<P: Provider>(s: &mut Side<P>) {
    let mut o = rnr_attr(2);
    o.attr.min_rnr_timer = if s.role == Role::A { 1 } else { 20 };
    let responder = rpc_core::verbs::types::rnr_timer(20);
    let mut c = connect(s, o);
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            let t0 = Instant::now();
            post_send(&mut c.qp, 1, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
            post_send(&mut c.qp, 2, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
            let wcs = poll_n(&mut c.cq, 2);
            let elapsed = t0.elapsed();
            assert_eq!(wcs[0].wr_id, 1);
            assert_eq!(wcs[0].status, WcStatus::RnrRetryExcErr, "{wcs:?}");
            assert_eq!(wcs[1].status, WcStatus::WrFlushErr, "{wcs:?}");
            assert!(
                elapsed >= responder * 2,
                "gave up after {elapsed:?}: fewer than 2 retries of the responder's {responder:?}"
            );
            assert_state_becomes(&c.qp, QpState::Error, "requester");
            s.barrier();
        }
        Role::B => s.barrier(),
    }
}

/// With rnr_retry = 7 a SEND waits as long as it takes for the receive.
pub fn rnr_retry_forever<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, rnr_attr(7));
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            write_mr(&mr, 0, b"late");
            post_send(&mut c.qp, 1, WrOp::Send, &[mr.sge(0, 4).unwrap()], SIG);
            let t0 = Instant::now();
            s.send(b"sent");
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 1);
            assert!(
                t0.elapsed() >= Duration::from_millis(50),
                "completed after {:?}, before the receive was posted",
                t0.elapsed()
            );
            s.barrier();
        }
        Role::B => {
            assert_eq!(s.recv(), b"sent");
            std::thread::sleep(Duration::from_millis(100));
            post_recv(&mut c.qp, 5, &[mr.sge(0, 64).unwrap()]);
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 5);
            assert_eq!(read_mr(&mr, 0, 4), b"late");
            s.barrier();
        }
    }
}

/// RC order within a QP: WRITEs land before a later SEND is received; completions come in
/// posting order.
pub fn ordering<P: Provider>(s: &mut Side<P>) {
    const N: u64 = 48;
    let mut o = Opts::default();
    o.caps.max_send_wr = 64;
    let mut c = connect(s, o);
    let mr = mr_all::<P>(&c.pd, 8192);
    match s.role {
        Role::A => {
            let r = s.recv_mr();
            for i in 0..N {
                write_mr(&mr, (i * 8) as usize, &i.to_le_bytes());
            }
            for i in 0..N {
                let sge = mr.sge((i * 8) as usize, 8).unwrap();
                // Each value to the same word and to its own slot.
                post_send(
                    &mut c.qp,
                    2 * i,
                    WrOp::Write {
                        remote_addr: r.addr,
                        rkey: r.rkey,
                    },
                    &[sge],
                    SIG,
                );
                post_send(
                    &mut c.qp,
                    2 * i + 1,
                    WrOp::Write {
                        remote_addr: r.addr + 1024 + i * 8,
                        rkey: r.rkey,
                    },
                    &[sge],
                    SendFlags::NONE,
                );
                if i % 8 == 7 {
                    let wcs = poll_n(&mut c.cq, 8);
                    let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
                    let want: Vec<u64> = (i - 7..=i).map(|k| 2 * k).collect();
                    assert_eq!(ids, want, "completions out of order");
                }
            }
            post_send(&mut c.qp, 1000, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
            assert_ok(&poll_n(&mut c.cq, 1)[0], 1000);
            s.barrier();
        }
        Role::B => {
            post_recv(&mut c.qp, 1, &[mr.sge(4096, 64).unwrap()]);
            s.send_mr(&mr.remote());
            assert_ok(&poll_n(&mut c.cq, 1)[0], 1);
            // The SEND was received: every earlier WRITE is visible.
            assert_eq!(u64_at(&mr, 0), N - 1);
            for i in 0..N {
                assert_eq!(u64_at(&mr, 1024 + (i * 8) as usize), i);
            }
            s.barrier();
        }
    }
}

/// Many QPs on one CQ: every completion names its QP, each receive lands in its own buffer.
pub fn many_qps_one_cq<P: Provider>(s: &mut Side<P>) {
    const N: usize = 8;
    let caps = QpCaps {
        max_send_wr: 4,
        max_recv_wr: 4,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let pd = s.ctx.alloc_pd().unwrap();
    let mut cq = s.ctx.create_cq((N * 8) as u32, None).unwrap();
    let attr = ConnectAttr::default();
    let mut qps: Vec<P::Qp> = (0..N)
        .map(|_| {
            let mut q = pd.create_qp(&cq, &cq, caps).unwrap();
            q.modify_to_init(attr.access).unwrap();
            q
        })
        .collect();
    let mine: Vec<u8> = qps.iter().flat_map(|q| q.endpoint().to_bytes()).collect();
    s.send(&mine);
    let theirs = s.recv();
    for (i, q) in qps.iter_mut().enumerate() {
        let ep = Endpoint::from_bytes(&theirs[i * Endpoint::ENCODED_LEN..]).unwrap();
        q.connect(&ep, &attr).unwrap();
    }
    s.barrier();
    let mr = mr_all::<P>(&pd, N * 64);
    match s.role {
        Role::A => {
            for (i, q) in qps.iter_mut().enumerate() {
                post_recv(q, i as u64, &[mr.sge(i * 64, 64).unwrap()]);
            }
            s.send(b"posted");
            let wcs = poll_n(&mut cq, N);
            let mut seen = [false; N];
            for wc in wcs {
                let i = wc.wr_id as usize;
                assert_eq!(wc.status, WcStatus::Success);
                assert_eq!(wc.qp_num, qps[i].qp_num(), "completion names the wrong QP");
                assert_eq!(read_mr(&mr, i * 64, 8), (i as u64 * 11).to_le_bytes());
                seen[i] = true;
            }
            assert!(seen.iter().all(|&x| x));
            s.barrier();
        }
        Role::B => {
            assert_eq!(s.recv(), b"posted");
            for (i, q) in qps.iter_mut().enumerate() {
                write_mr(&mr, i * 64, &(i as u64 * 11).to_le_bytes());
                post_send(
                    q,
                    100 + i as u64,
                    WrOp::Send,
                    &[mr.sge(i * 64, 8).unwrap()],
                    SIG,
                );
            }
            let wcs = poll_n(&mut cq, N);
            for wc in wcs {
                let i = wc.wr_id as usize - 100;
                assert_eq!(wc.qp_num, qps[i].qp_num());
                assert_eq!(wc.status, WcStatus::Success);
            }
            s.barrier();
        }
    }
}

/// A peer process killed (SIGKILL) while operations are outstanding: they fail with
/// RETRY_EXC_ERR (the rest is flushed) instead of hanging. Two-process and two-host modes only.
pub fn peer_killed<P: Provider>(s: &mut Side<P>) {
    if !matches!(s.mode, Mode::Processes | Mode::Remote) {
        return; // needs a process to kill
    }
    let mut o = rnr_attr(7);
    o.attr.timeout = 10; // 4 ms ACK timeout, so hardware gives up quickly too
    o.attr.retry_cnt = 3;
    let mut c = connect(s, o);
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            assert_eq!(s.recv(), b"ready");
            // B posts no receive: the SEND waits (RNR, forever), the WRITE queues behind it.
            post_send(&mut c.qp, 1, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
            let r = s.recv_mr();
            let w = WrOp::Write {
                remote_addr: r.addr,
                rkey: r.rkey,
            };
            post_send(&mut c.qp, 2, w, &[mr.sge(0, 8).unwrap()], SIG);
            assert!(poll_for(&mut c.cq, Duration::from_millis(10)).is_empty());
            let t0 = Instant::now();
            s.kill_peer();
            let wcs = poll_n(&mut c.cq, 2);
            assert_eq!(wcs[0].wr_id, 1);
            assert_eq!(wcs[0].status, WcStatus::RetryExcErr, "{wcs:?}");
            assert_eq!(wcs[1].status, WcStatus::WrFlushErr, "{wcs:?}");
            assert!(t0.elapsed() < WC_TIMEOUT);
            assert_state_becomes(&c.qp, QpState::Error, "requester");
            // Later work fails at once instead of hanging.
            post_send(&mut c.qp, 3, w, &[mr.sge(0, 8).unwrap()], SIG);
            assert_eq!(poll_n(&mut c.cq, 1)[0].status, WcStatus::WrFlushErr);
        }
        Role::B => {
            s.send(b"ready");
            s.send_mr(&mr.remote());
            // Wait to be killed (bounded by the side channel's timeout).
            let _ = s.recv();
            panic!("side B was supposed to be killed");
        }
    }
}

/// CQ overrun is prevented by sizing: a QP whose queues could overflow its CQ is refused.
pub fn cq_overrun_prevented<P: Provider>(s: &mut Side<P>) {
    let pd = s.ctx.alloc_pd().unwrap();
    let mut cq = s.ctx.create_cq(8, None).unwrap();
    let caps = |send, recv| QpCaps {
        max_send_wr: send,
        max_recv_wr: recv,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let e = pd.create_qp(&cq, &cq, caps(8, 8)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ExceedsCaps, "{e}");
    assert_eq!(cq.room(), 8, "a refused QP reserves nothing");
    let q1 = pd.create_qp(&cq, &cq, caps(4, 4)).unwrap();
    assert_eq!(cq.room(), 0, "a QP reserves its queue depths");
    let e = pd.create_qp(&cq, &cq, caps(1, 1)).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::ExceedsCaps, "{e}");
    let scq = s.ctx.create_cq(8, None).unwrap();
    let rcq = s.ctx.create_cq(8, None).unwrap();
    let _q2 = pd.create_qp(&scq, &rcq, caps(8, 3)).unwrap();
    assert_eq!((scq.room(), rcq.room()), (0, 5), "each queue on its own CQ");
    drop(q1);
    // The soft RNIC's CQ lets go of a destroyed QP when it is next polled.
    let mut wcs = [Wc::default(); 4];
    assert_eq!(cq.poll(&mut wcs).unwrap(), 0);
    assert_eq!(cq.room(), 8, "a destroyed QP gives its room back");
    assert!(s.ctx.create_cq(0, None).is_err());
    assert!(s.ctx.create_cq(s.ctx.caps().max_cqe + 1, None).is_err());
    s.barrier();
}

/// Posting in a state that does not allow it is an error, not undefined behaviour.
pub fn post_before_rts<P: Provider>(s: &mut Side<P>) {
    let pd = s.ctx.alloc_pd().unwrap();
    let cq = s.ctx.create_cq(256, None).unwrap();
    let mut qp = pd.create_qp(&cq, &cq, Opts::default().caps).unwrap();
    let mr = mr_all::<P>(&pd, 64);
    let sge = [mr.sge(0, 8).unwrap()];
    let recv = [RecvWr {
        wr_id: 1,
        sg_list: &sge,
    }];
    let send = [SendWr {
        wr_id: 2,
        op: WrOp::Send,
        sg_list: &sge,
        flags: SIG,
    }];
    // SAFETY: nothing is posted (refused), or the receive stays posted while `mr` lives.
    unsafe {
        let e = qp.post_recv(&recv).unwrap_err();
        assert_eq!((e.posted, e.error.kind()), (0, ErrorKind::InvalidState));
        let e = qp.post_send(&send).unwrap_err();
        assert_eq!((e.posted, e.error.kind()), (0, ErrorKind::InvalidState));
        let attr = ConnectAttr::default();
        qp.modify_to_init(attr.access).unwrap();
        assert!(qp.modify_to_init(attr.access).is_err(), "INIT -> INIT");
        assert!(qp.modify_to_rts(&attr).is_err(), "INIT -> RTS");
        let e = qp.post_send(&send).unwrap_err();
        assert_eq!(e.error.kind(), ErrorKind::InvalidState);
        qp.post_recv(&recv).expect("post_recv in INIT");
        let remote = s.exchange_endpoint(&qp.endpoint());
        qp.modify_to_rtr(&remote, &attr).unwrap();
        let e = qp.post_send(&send).unwrap_err();
        assert_eq!(e.error.kind(), ErrorKind::InvalidState, "post_send in RTR");
        qp.modify_to_rts(&attr).unwrap();
    }
    s.barrier();
}

/// More work requests than the queue depth: back-pressure with the count posted, and room
/// again once completions are polled.
pub fn queue_full<P: Provider>(s: &mut Side<P>) {
    let mut o = Opts::default();
    o.caps.max_send_wr = 4;
    o.caps.max_recv_wr = 2;
    let mut c = connect(s, o);
    let mr = mr_all::<P>(&c.pd, 4096);
    match s.role {
        Role::A => {
            let r = s.recv_mr();
            let sge = [mr.sge(0, 8).unwrap()];
            let w = |id, flags| SendWr {
                wr_id: id,
                op: WrOp::Write {
                    remote_addr: r.addr,
                    rkey: r.rkey,
                },
                sg_list: &sge,
                flags,
            };
            let none = SendFlags::NONE;
            let wrs = [w(1, none), w(2, none), w(3, none), w(4, SIG), w(5, SIG)];
            // SAFETY: `mr` outlives the completions.
            let e = unsafe { c.qp.post_send(&wrs) }.unwrap_err();
            assert_eq!(e.posted, 4, "{e}");
            assert_eq!(e.error.kind(), ErrorKind::QueueFull, "{e}");
            assert!(e.error.is_queue_full());
            // Unsignaled requests are freed by the later signaled completion.
            assert_ok(&poll_n(&mut c.cq, 1)[0], 4);
            // SAFETY: as above.
            unsafe { c.qp.post_send(&wrs[4..]) }.expect("room again after polling");
            assert_ok(&poll_n(&mut c.cq, 1)[0], 5);
            let rs = [mr.sge(64, 8).unwrap()];
            let recvs = [
                RecvWr {
                    wr_id: 10,
                    sg_list: &rs,
                },
                RecvWr {
                    wr_id: 11,
                    sg_list: &rs,
                },
                RecvWr {
                    wr_id: 12,
                    sg_list: &rs,
                },
            ];
            // SAFETY: as above.
            let e = unsafe { c.qp.post_recv(&recvs) }.unwrap_err();
            assert_eq!((e.posted, e.error.kind()), (2, ErrorKind::QueueFull));
            s.barrier();
        }
        Role::B => {
            s.send_mr(&mr.remote());
            s.barrier();
        }
    }
}

/// Forged or foreign endpoints are refused at connect time (or, where the provider cannot
/// tell at connect time, every operation fails instead of reaching someone else); the QP can
/// still be connected to the real endpoint afterwards.
pub fn forged_endpoint<P: Provider>(s: &mut Side<P>) {
    let pd = s.ctx.alloc_pd().unwrap();
    let mut cq = s.ctx.create_cq(256, None).unwrap();
    let attr = ConnectAttr {
        timeout: 10,
        retry_cnt: 2,
        ..ConnectAttr::default()
    };
    let mut qp = pd.create_qp(&cq, &cq, Opts::default().caps).unwrap();
    qp.modify_to_init(attr.access).unwrap();
    let real = s.exchange_endpoint(&qp.endpoint());
    if s.role == Role::A {
        let mut bytes = real.to_bytes();
        bytes[0] ^= 0xff;
        assert!(Endpoint::from_bytes(&bytes).is_err(), "bad magic accepted");
        assert!(
            Endpoint::from_bytes(&real.to_bytes()[..20]).is_err(),
            "truncated accepted"
        );
        let other_tag = if real.provider == Endpoint::PROVIDER_SOFT {
            Endpoint::PROVIDER_IB
        } else {
            Endpoint::PROVIDER_SOFT
        };
        let mut forged = [real, real, real, real];
        forged[0].provider = other_tag;
        forged[1].gid[15] ^= 0x5a;
        forged[1].gid[9] ^= 0x11;
        forged[2].qp_num ^= 0x0008_0000;
        forged[3].gid[0..4].copy_from_slice(&0x7fff_fff0u32.to_le_bytes());
        for (i, ep) in forged.iter().enumerate() {
            match qp.modify_to_rtr(ep, &attr) {
                Err(e) => {
                    assert_eq!(e.kind(), ErrorKind::InvalidEndpoint, "forged #{i}: {e}");
                    assert_eq!(qp.state(), QpState::Init, "forged #{i} left the QP in INIT");
                }
                Ok(()) => {
                    assert!(i != 0, "an endpoint of another provider was accepted");
                    // The provider cannot validate at connect time (ib): nothing may work.
                    qp.modify_to_rts(&attr).unwrap();
                    let mr = mr_all::<P>(&pd, 64);
                    post_send(&mut qp, 1, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
                    let wc = poll_n(&mut cq, 1)[0];
                    assert_eq!(wc.status, WcStatus::RetryExcErr, "forged #{i}: {wc:?}");
                    return_to_init(&mut qp, &attr);
                }
            }
        }
        qp.connect(&real, &attr)
            .expect("the real endpoint still connects");
    }
    s.barrier();
}

fn return_to_init<Q: Qp>(qp: &mut Q, attr: &ConnectAttr) {
    qp.modify_to_reset().unwrap();
    qp.modify_to_init(attr.access).unwrap();
}

/// Zero-length, overflowing, unmapped and badly flagged registrations are refused.
pub fn bad_registration<P: Provider>(s: &mut Side<P>) {
    let pd = s.ctx.alloc_pd().unwrap();
    let e = pd.alloc_mr(0, Access::ALL).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = pd.alloc_mr(64, Access::REMOTE_WRITE).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let e = pd
        .alloc_mr(64, Access::REMOTE_ATOMIC | Access::REMOTE_READ)
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    let mut buf = vec![0u8; 4096];
    // SAFETY: every call is refused, so nothing is registered.
    unsafe {
        let e = pd.reg_mr(buf.as_mut_ptr(), 0, Access::ALL).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        let e = pd
            .reg_mr(buf.as_mut_ptr(), usize::MAX, Access::ALL)
            .unwrap_err();
        assert!(
            matches!(
                e.kind(),
                ErrorKind::InvalidArgument | ErrorKind::ExceedsCaps
            ),
            "{e}"
        );
        let e = pd
            .reg_mr((usize::MAX - 10) as *mut u8, 100, Access::ALL)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
    }
    // A valid one, for contrast.
    // SAFETY: `buf` outlives the region (dropped first).
    let mr = unsafe { pd.reg_mr(buf.as_mut_ptr(), buf.len(), Access::ALL) }.unwrap();
    assert_eq!(mr.len(), 4096);
    assert!(mr.sge(4000, 200).is_none());
    drop(mr);
    s.barrier();
}

/// Regions registered on ordinary memory (not allocated by the provider) work as targets of
/// WRITE, READ and SEND.
pub fn user_memory<P: Provider>(s: &mut Side<P>) {
    let mut c = connect(s, Opts::default());
    let mut buf = vec![0u8; 16384];
    // SAFETY: `buf` outlives the region (the region is dropped first, below).
    let umr = unsafe { c.pd.reg_mr(buf.as_mut_ptr(), buf.len(), Access::ALL) }.unwrap();
    match s.role {
        Role::A => {
            let r = s.recv_mr();
            write_mr(&umr, 0, &pattern(11, 3000));
            let w = WrOp::Write {
                remote_addr: r.addr + 100,
                rkey: r.rkey,
            };
            post_send(&mut c.qp, 1, w, &[umr.sge(0, 3000).unwrap()], SIG);
            assert_ok(&poll_n(&mut c.cq, 1)[0], 1);
            let rd = WrOp::Read {
                remote_addr: r.addr + 8000,
                rkey: r.rkey,
            };
            post_send(&mut c.qp, 2, rd, &[umr.sge(4000, 500).unwrap()], SIG);
            assert_ok(&poll_n(&mut c.cq, 1)[0], 2);
            assert_eq!(read_mr(&umr, 4000, 500), pattern(12, 500));
            assert_eq!(s.recv(), b"posted");
            write_mr(&umr, 6000, &pattern(13, 77));
            post_send(&mut c.qp, 3, WrOp::Send, &[umr.sge(6000, 77).unwrap()], SIG);
            assert_ok(&poll_n(&mut c.cq, 1)[0], 3);
            s.barrier();
        }
        Role::B => {
            write_mr(&umr, 8000, &pattern(12, 500));
            s.send_mr(&umr.remote());
            post_recv(&mut c.qp, 9, &[umr.sge(12_000, 100).unwrap()]);
            s.send(b"posted");
            let wc = poll_n(&mut c.cq, 1)[0];
            assert_ok(&wc, 9);
            assert_eq!(wc.byte_len, 77);
            s.barrier();
            assert_eq!(read_mr(&umr, 100, 3000), pattern(11, 3000));
            assert_eq!(read_mr(&umr, 12_000, 77), pattern(13, 77));
        }
    }
    drop(umr);
    drop(buf);
}

/// The completion channel wakes a sleeper when an armed CQ gets a completion.
pub fn channel_wakes_sleeper<P: Provider>(s: &mut Side<P>) {
    let pd = s.ctx.alloc_pd().unwrap();
    let ch = s.ctx.create_comp_channel().unwrap();
    let mut cq = s.ctx.create_cq(256, Some(&ch)).unwrap();
    let attr = ConnectAttr::default();
    let mut qp = pd.create_qp(&cq, &cq, Opts::default().caps).unwrap();
    qp.modify_to_init(attr.access).unwrap();
    let remote = s.exchange_endpoint(&qp.endpoint());
    qp.connect(&remote, &attr).unwrap();
    s.barrier();
    let mr = mr_all::<P>(&pd, 64);
    match s.role {
        Role::A => {
            assert_eq!(s.recv(), b"sleeping");
            std::thread::sleep(Duration::from_millis(30));
            post_send(&mut qp, 1, WrOp::Send, &[mr.sge(0, 8).unwrap()], SIG);
            assert_ok(&poll_n(&mut cq, 1)[0], 1);
            s.barrier();
        }
        Role::B => {
            post_recv(&mut qp, 7, &[mr.sge(0, 64).unwrap()]);
            let mut wc = [rpc_core::verbs::Wc::default(); 4];
            assert_eq!(cq.poll(&mut wc).unwrap(), 0);
            cq.req_notify(false).unwrap();
            assert_eq!(cq.poll(&mut wc).unwrap(), 0, "nothing yet: A waits for us");
            s.send(b"sleeping");
            let t0 = Instant::now();
            let mut got = 0;
            while got == 0 {
                assert!(
                    t0.elapsed() < WC_TIMEOUT,
                    "the sleeper was not woken within {WC_TIMEOUT:?}"
                );
                let woke = wait_channel(&ch, Duration::from_secs(5));
                assert!(
                    woke,
                    "wait timed out: the completion did not ring the channel"
                );
                got = cq.poll(&mut wc).unwrap();
                if got == 0 {
                    cq.req_notify(false).unwrap();
                    got = cq.poll(&mut wc).unwrap();
                }
            }
            assert_ok(&wc[0], 7);
            assert!(ch.drain().is_ok());
            s.barrier();
        }
    }
}

/// Memory windows (`Pd::bind_window`): a loan of a range of a local-only region to the peer of
/// one QP, with one right, under a fresh key, revoked when dropped. Side A plays the rogue
/// peer: every access outside the loan fails with REM_ACCESS_ERR (its QP goes to ERROR, as RC
/// does), and B's memory outside the loan is never touched.
pub fn window_loans<P: Provider>(s: &mut Side<P>) {
    const LEN: usize = 1 << 16;
    const OFF: usize = 4096;
    const WIN: usize = 8192;
    let names = [
        "read inside the loan",
        "read past the loan",
        "write through a read loan",
        "the region's own key",
        "after revocation",
        "another peer's loan",
    ];
    for (k, name) in names.iter().enumerate() {
        // Soft binds a window to the peer RNIC; ib's windows (registrations of the range)
        // answer any QP of the protection domain while they live.
        if k == 5 && P::NAME != "soft" {
            continue;
        }
        let mut c = connect(s, Opts::default());
        match s.role {
            Role::A => {
                let w = s.recv_mr();
                let own = s.recv_mr();
                let mr = mr_all::<P>(&c.pd, LEN);
                // A second device of this side (another peer for B's RNIC), connected to B's
                // second QP, which tries the key B lent to the first.
                let mut second = (k == 5).then(|| {
                    let ctx = P::open(None).expect("a second context");
                    let pd = ctx.alloc_pd().expect("alloc_pd");
                    let mut cq = ctx.create_cq(256, None).expect("create_cq");
                    let mut qp = pd.create_qp(&cq, &cq, Opts::default().caps).unwrap();
                    qp.modify_to_init(Access::ALL).unwrap();
                    let remote = s.exchange_endpoint(&qp.endpoint());
                    qp.connect(&remote, &ConnectAttr::default()).unwrap();
                    s.barrier();
                    let _ = poll_for(&mut cq, Duration::from_millis(1));
                    let mr = mr_all::<P>(&pd, LEN);
                    (ctx, pd, cq, qp, mr)
                });
                let (op, len) = match k {
                    0 | 4 | 5 => (
                        WrOp::Read {
                            remote_addr: w.addr,
                            rkey: w.rkey,
                        },
                        WIN,
                    ),
                    1 => (
                        WrOp::Read {
                            remote_addr: w.addr + w.len - 32,
                            rkey: w.rkey,
                        },
                        64,
                    ),
                    2 => (
                        WrOp::Write {
                            remote_addr: w.addr,
                            rkey: w.rkey,
                        },
                        64,
                    ),
                    _ => (
                        WrOp::Read {
                            remote_addr: own.addr + OFF as u64,
                            rkey: own.rkey,
                        },
                        64,
                    ),
                };
                let sge = [mr.sge(0, len as u32).unwrap()];
                if k == 4 {
                    // Inside the loan it works; B then revokes it; the same read fails.
                    post_send(&mut c.qp, 1, op, &sge, SIG);
                    assert_ok(&poll_n(&mut c.cq, 1)[0], 1);
                    assert_eq!(read_mr(&mr, 0, WIN), &pattern(7, LEN)[OFF..OFF + WIN]);
                    s.barrier();
                    s.barrier();
                }
                let (qp, cq, sge) = match second.as_mut() {
                    Some((_, _, cq, qp, mr)) => (qp, cq, [mr.sge(0, len as u32).unwrap()]),
                    None => (&mut c.qp, &mut c.cq, sge),
                };
                post_send(qp, 9, op, &sge, SIG);
                let wc = poll_n(cq, 1)[0];
                assert_eq!(wc.wr_id, 9);
                if k == 0 {
                    assert_ok(&wc, 9);
                    assert_eq!(read_mr(&mr, 0, WIN), &pattern(7, LEN)[OFF..OFF + WIN]);
                } else {
                    assert_eq!(wc.status, WcStatus::RemAccessErr, "{name}: {wc:?}");
                    assert_state_becomes(qp, QpState::Error, &format!("{name}: requester"));
                }
                s.barrier();
            }
            Role::B => {
                let mr = c.pd.alloc_mr(LEN, Access::LOCAL_WRITE).unwrap();
                write_mr(&mr, 0, &pattern(7, LEN));
                let access = Access::REMOTE_READ;
                let mut window = Some(
                    c.pd.bind_window(&mr, OFF, WIN, access, &c.qp)
                        .expect("bind_window"),
                );
                let w = window.as_ref().map(|w| w.remote()).unwrap();
                assert_eq!(w.len, WIN as u64);
                assert_eq!(w.addr, mr.addr() + OFF as u64);
                assert_ne!(w.rkey, mr.rkey(), "{name}: a fresh key");
                s.send_mr(&w);
                s.send_mr(&mr.remote());
                let _second = (k == 5).then(|| {
                    let cq = s.ctx.create_cq(256, None).expect("create_cq");
                    let mut qp = c.pd.create_qp(&cq, &cq, Opts::default().caps).unwrap();
                    qp.modify_to_init(Access::ALL).unwrap();
                    let remote = s.exchange_endpoint(&qp.endpoint());
                    qp.connect(&remote, &ConnectAttr::default()).unwrap();
                    s.barrier();
                    (cq, qp)
                });
                if k == 4 {
                    s.barrier();
                    window = None;
                    s.barrier();
                }
                s.barrier();
                drop(window);
                assert_eq!(read_mr(&mr, 0, LEN), pattern(7, LEN), "{name}: B's bytes");
            }
        }
    }
}

/// Windows refuse what no loan may be: an empty or outside range, local rights, remote write
/// on a region without LOCAL_WRITE.
pub fn window_arguments<P: Provider>(s: &mut Side<P>) {
    let c = connect(s, Opts::default());
    let ro = c.pd.alloc_mr(4096, Access::NONE).unwrap();
    let rw = c.pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let bad = [
        (&rw, 0, 0, Access::REMOTE_READ, "empty"),
        (&rw, 4000, 200, Access::REMOTE_READ, "outside"),
        (&rw, 0, 100, Access::LOCAL_WRITE, "a local right"),
        (&rw, 0, 100, Access::NONE, "no right"),
        (
            &ro,
            0,
            100,
            Access::REMOTE_WRITE,
            "write without LOCAL_WRITE",
        ),
    ];
    for (mr, off, len, access, what) in bad {
        let e =
            c.pd.bind_window(mr, off, len, access, &c.qp)
                .expect_err(what);
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{what}: {e}");
    }
    assert!(
        c.pd.bind_window(&ro, 0, 100, Access::REMOTE_READ, &c.qp)
            .is_ok()
    );
    s.barrier();
}
