//! Smoke tests of the `ib` provider on a real RDMA device: open, register, connect two RC QPs
//! on one device (loopback) and run every operation, plus the error paths.
//!
//! On a host without an RDMA device every test prints `SKIP` and passes. Inside the project's
//! Soft-RoCE VM (`softroce/vm.sh`, which sets `SOFTROCE=1`) a missing device is a failure, so
//! the tests can never pass there by skipping. `RPC_IB_REQUIRE_DEVICE=1` does the same on a
//! cluster node.
#![cfg(feature = "ibverbs")]
#![allow(clippy::unwrap_used)] // test helpers panic on purpose: a failure is a test failure

use std::time::{Duration, Instant};

use rpc_core::verbs::ib::{GidChoice, HcaSpec, Ib, IbContext, IbCq, IbMr, IbPd, IbQp, rail_of};
use rpc_core::verbs::{
    Access, CompChannel, ConnectAttr, Context, Cq, ErrorKind, LinkLayer, Mr, Pd, Provider, Qp,
    QpCaps, QpGroup, QpState, RecvWr, SendFlags, SendWr, Sge, Wc, WcError, WcOpcode, WcStatus,
    WrOp,
};

/// How long any single completion may take (Soft-RoCE under TCG is slow, not stuck).
const WAIT: Duration = Duration::from_secs(20);

fn device_required() -> bool {
    std::env::var_os("SOFTROCE").is_some() || std::env::var_os("RPC_IB_REQUIRE_DEVICE").is_some()
}

/// Opens the default device, or `None` (with a SKIP line) when the host has none.
fn open_or_skip(test: &str) -> Option<IbContext> {
    match Ib::open(None) {
        Ok(c) => Some(c),
        Err(e) if e.kind() == ErrorKind::NoDevice && !device_required() => {
            eprintln!("SKIP {test}: no RDMA device on this host ({e})");
            None
        }
        Err(e) => panic!("{test}: cannot open an RDMA device: {e}"),
    }
}

/// Copies bytes out of a region.
fn read(mr: &IbMr, off: usize, len: usize) -> Vec<u8> {
    assert!(off + len <= mr.len());
    let mut v = vec![0u8; len];
    // SAFETY: the range is inside the live region (asserted); the tests call this only when
    // no work request that writes the range is outstanding (its completion was polled).
    unsafe { std::ptr::copy_nonoverlapping(mr.as_ptr().add(off), v.as_mut_ptr(), len) };
    v
}

/// Copies bytes into a region.
fn write(mr: &IbMr, off: usize, data: &[u8]) {
    assert!(off + data.len() <= mr.len());
    // SAFETY: the range is inside the live region (asserted); no work request that reads or
    // writes the range is outstanding when the tests call this.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), mr.as_ptr().add(off), data.len()) };
}

fn read_u64(mr: &IbMr, off: usize) -> u64 {
    u64::from_ne_bytes(read(mr, off, 8).try_into().unwrap())
}

/// Polls `cq` until it yields one completion, or panics after [`WAIT`].
fn poll_one(cq: &mut IbCq) -> Wc {
    let deadline = Instant::now() + WAIT;
    let mut wc = [Wc::default(); 1];
    loop {
        if cq.poll(&mut wc).unwrap() == 1 {
            return wc[0];
        }
        assert!(Instant::now() < deadline, "no completion within {WAIT:?}");
        std::thread::yield_now();
    }
}

fn poll_n(cq: &mut IbCq, n: usize) -> Vec<Wc> {
    let mut out = Vec::new();
    let deadline = Instant::now() + WAIT;
    let mut wc = [Wc::default(); 8];
    while out.len() < n {
        let k = cq.poll(&mut wc).unwrap();
        out.extend_from_slice(&wc[..k]);
        assert!(
            Instant::now() < deadline,
            "{} of {n} completions within {WAIT:?}",
            out.len()
        );
        if k == 0 {
            std::thread::yield_now();
        }
    }
    out
}

fn ok(wc: Wc) -> Wc {
    if let Err(e) = WcError::check(&wc) {
        panic!("{e}");
    }
    wc
}

/// Two RC QPs of one device connected to each other, each with its CQ and a 64 KiB region.
struct Pair {
    ctx: IbContext,
    _pd: IbPd,
    cq_a: IbCq,
    cq_b: IbCq,
    a: IbQp,
    b: IbQp,
    mr_a: IbMr,
    mr_b: IbMr,
}

const LEN: usize = 64 << 10;

fn pair_with(test: &str, caps: QpCaps, attr: ConnectAttr) -> Option<Pair> {
    let ctx = open_or_skip(test)?;
    let pd = ctx.alloc_pd().unwrap();
    let cq_a = ctx.create_cq(512, None).unwrap();
    let cq_b = ctx.create_cq(512, None).unwrap();
    let mut a = pd.create_qp(&cq_a, &cq_a, caps).unwrap();
    let mut b = pd.create_qp(&cq_b, &cq_b, caps).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb, &attr).unwrap();
    b.connect(&ea, &attr).unwrap();
    let mr_a = pd.alloc_mr(LEN, Access::ALL).unwrap();
    let mr_b = pd.alloc_mr(LEN, Access::ALL).unwrap();
    Some(Pair {
        ctx,
        _pd: pd,
        cq_a,
        cq_b,
        a,
        b,
        mr_a,
        mr_b,
    })
}

fn pair(test: &str) -> Option<Pair> {
    pair_with(test, QpCaps::default(), ConnectAttr::default())
}

#[test]
fn open_reports_device_port_gid_and_caps() {
    let t = Instant::now();
    let Some(ctx) = open_or_skip("open_reports_device_port_gid_and_caps") else {
        return;
    };
    let took = t.elapsed();
    let devs = Ib::devices().unwrap();
    assert!(!devs.is_empty());
    let info = ctx.info();
    assert_eq!(info.provider, "ib");
    assert!(
        devs.iter()
            .any(|d| d.name == info.name && d.port == info.port)
    );
    assert!(
        [256, 512, 1024, 2048, 4096].contains(&info.active_mtu),
        "{info:?}"
    );
    let caps = ctx.caps();
    assert!(
        caps.max_qp_wr >= 128 && caps.max_sge >= 1 && caps.max_cqe >= 512,
        "{caps:?}"
    );
    assert!(caps.max_inline > 0, "inline probe found nothing: {caps:?}");
    if info.link_layer == LinkLayer::Ethernet {
        assert_ne!(ctx.gid().gid, [0; 16], "RoCE needs a GID");
    }
    if std::env::var_os("RPC_IB_GID_INDEX").is_some() || std::env::var_os("RPC_IB_HCA").is_some() {
        // env_overrides_apply covers this configuration.
        return;
    }
    if let Ok(idx) = std::env::var("SOFTROCE_GID_INDEX") {
        // Soft-RoCE on dummy0: index 1 is the IPv4-mapped RoCE v2 GID, which the automatic
        // choice must find.
        assert_eq!(ctx.gid().index.to_string(), idx, "{ctx:?}");
        assert!(ctx.gid().ipv4().is_some(), "{ctx:?}");
        assert_eq!(info.link_layer, LinkLayer::Ethernet);
        assert!(caps.atomics);
    }
    println!("opened in {took:?}: {ctx:?}");
}

#[test]
fn unknown_hca_is_no_device_with_the_list() {
    let spec = HcaSpec::parse("=no_such_hca0").unwrap();
    let e = Ib::open_spec(&spec, None).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NoDevice);
    let msg = e.to_string();
    if Ib::devices().unwrap().is_empty() {
        if device_required() {
            panic!("no RDMA device inside the Soft-RoCE VM: {msg}");
        }
        // The no-device message says how to get one.
        assert!(msg.contains("rdma link add rxe0 type rxe netdev"), "{msg}");
        assert!(msg.contains("RPC_PROVIDER=soft"), "{msg}");
        eprintln!("no device: {msg}");
    } else {
        assert!(
            msg.contains("RPC_IB_HCA") && msg.contains("matches none"),
            "{msg}"
        );
    }
}

#[test]
fn send_recv_and_send_with_imm() {
    let Some(mut p) = pair("send_recv_and_send_with_imm") else {
        return;
    };
    write(&p.mr_a, 0, b"hello over RDMA");
    let r0 = [p.mr_b.sge(0, 4096).unwrap()];
    let r1 = [p.mr_b.sge(4096, 4096).unwrap()];
    // SAFETY: the receive buffers are in live regions with LOCAL_WRITE and are read only
    // after their completions are polled.
    unsafe {
        p.b.post_recv(&[
            RecvWr {
                wr_id: 10,
                sg_list: &r0,
            },
            RecvWr {
                wr_id: 11,
                sg_list: &r1,
            },
        ])
        .unwrap();
    }
    let s = [p.mr_a.sge(0, 15).unwrap()];
    // SAFETY: the source bytes stay untouched until the send completions are polled.
    unsafe {
        p.a.post_send(&[
            SendWr {
                wr_id: 1,
                op: WrOp::Send,
                sg_list: &s,
                flags: SendFlags::SIGNALED,
            },
            SendWr {
                wr_id: 2,
                op: WrOp::SendWithImm { imm: 0xdead_beef },
                sg_list: &s,
                flags: SendFlags::SIGNALED | SendFlags::SOLICITED,
            },
        ])
        .unwrap();
    }
    let sends = poll_n(&mut p.cq_a, 2);
    assert_eq!(
        sends
            .iter()
            .map(|w| (ok(*w).wr_id, w.opcode))
            .collect::<Vec<_>>(),
        [(1, WcOpcode::Send), (2, WcOpcode::Send)]
    );
    let w = ok(poll_one(&mut p.cq_b));
    assert_eq!(
        (w.wr_id, w.opcode, w.byte_len, w.imm()),
        (10, WcOpcode::Recv, 15, None)
    );
    assert_eq!(w.qp_num, p.b.qp_num());
    let w = ok(poll_one(&mut p.cq_b));
    assert_eq!((w.wr_id, w.byte_len, w.imm()), (11, 15, Some(0xdead_beef)));
    assert_eq!(read(&p.mr_b, 0, 15), b"hello over RDMA");
    assert_eq!(read(&p.mr_b, 4096, 15), b"hello over RDMA");
}

#[test]
fn inline_send_needs_no_registered_source() {
    let Some(mut p) = pair("inline_send_needs_no_registered_source") else {
        return;
    };
    let r = [p.mr_b.sge(0, 256).unwrap()];
    // SAFETY: live region with LOCAL_WRITE, read after the completion.
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &r,
        }])
        .unwrap()
    };
    let stack = *b"inline!";
    // An inline SGE is copied at post time: any address, no lkey.
    let s = [Sge {
        addr: stack.as_ptr() as u64,
        length: stack.len() as u32,
        lkey: 0,
    }];
    // SAFETY: inline data is copied before post_send returns.
    unsafe {
        p.a.post_send(&[SendWr {
            wr_id: 5,
            op: WrOp::Send,
            sg_list: &s,
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        }])
        .unwrap();
    }
    ok(poll_one(&mut p.cq_a));
    let w = ok(poll_one(&mut p.cq_b));
    assert_eq!(w.byte_len, 7);
    assert_eq!(read(&p.mr_b, 0, 7), b"inline!");
    // Over the QP's inline limit: refused before reaching the device.
    let big = vec![0u8; p.a.caps().max_inline_data as usize + 1];
    let s = [Sge {
        addr: big.as_ptr() as u64,
        length: big.len() as u32,
        lkey: 0,
    }];
    // SAFETY: refused before anything is posted.
    let e = unsafe {
        p.a.post_send(&[SendWr {
            wr_id: 6,
            op: WrOp::Send,
            sg_list: &s,
            flags: SendFlags::SIGNALED | SendFlags::INLINE,
        }])
    }
    .unwrap_err();
    assert_eq!((e.posted, e.error.kind()), (0, ErrorKind::InvalidArgument));
}

#[test]
fn rdma_write_and_write_with_imm() {
    let Some(mut p) = pair("rdma_write_and_write_with_imm") else {
        return;
    };
    let data: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    write(&p.mr_a, 0, &data);
    let remote = p.mr_b.remote().slice(1000, data.len() as u64).unwrap();
    let s = [p.mr_a.sge(0, data.len() as u32).unwrap()];
    let r = [p.mr_b.sge(60_000, 64).unwrap()];
    // SAFETY: B's receive buffer is in a live region with LOCAL_WRITE; A's source stays
    // untouched and B's target is not read until the completions are polled.
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 77,
            sg_list: &r,
        }])
        .unwrap();
        p.a.post_send(&[
            SendWr {
                wr_id: 1,
                op: WrOp::Write {
                    remote_addr: remote.addr,
                    rkey: remote.rkey,
                },
                sg_list: &s,
                flags: SendFlags::NONE,
            },
            SendWr {
                wr_id: 2,
                op: WrOp::WriteWithImm {
                    remote_addr: remote.addr,
                    rkey: remote.rkey,
                    imm: 42,
                },
                sg_list: &[],
                flags: SendFlags::SIGNALED,
            },
        ])
        .unwrap();
    }
    // The unsignaled WRITE completes with the signaled one behind it.
    let w = ok(poll_one(&mut p.cq_a));
    assert_eq!((w.wr_id, w.opcode), (2, WcOpcode::RdmaWrite));
    let w = ok(poll_one(&mut p.cq_b));
    assert_eq!(
        (w.wr_id, w.opcode, w.imm(), w.byte_len),
        (77, WcOpcode::RecvRdmaWithImm, Some(42), 0)
    );
    assert_eq!(read(&p.mr_b, 1000, data.len()), data);
}

#[test]
fn rdma_read() {
    let Some(mut p) = pair("rdma_read") else {
        return;
    };
    let data: Vec<u8> = (0..9000u32).map(|i| (i * 7 % 256) as u8).collect();
    write(&p.mr_b, 100, &data);
    let remote = p.mr_b.remote().slice(100, data.len() as u64).unwrap();
    let s = [p.mr_a.sge(500, data.len() as u32).unwrap()];
    // SAFETY: the target range in A is not read until the completion is polled.
    unsafe {
        p.a.post_send(&[SendWr {
            wr_id: 3,
            op: WrOp::Read {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            },
            sg_list: &s,
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
    }
    let w = ok(poll_one(&mut p.cq_a));
    assert_eq!(
        (w.wr_id, w.opcode, w.byte_len),
        (3, WcOpcode::RdmaRead, 9000)
    );
    assert_eq!(read(&p.mr_a, 500, data.len()), data);
}

#[test]
fn atomics_compare_swap_and_fetch_add() {
    let Some(mut p) = pair("atomics_compare_swap_and_fetch_add") else {
        return;
    };
    if !p.ctx.caps().atomics {
        eprintln!("SKIP atomics: {} has no atomics", p.ctx.info().name);
        return;
    }
    write(&p.mr_b, 64, &100u64.to_ne_bytes());
    let rk = p.mr_b.rkey();
    let word = p.mr_b.addr() + 64;
    let old0 = [p.mr_a.sge(0, 8).unwrap()];
    let old1 = [p.mr_a.sge(8, 8).unwrap()];
    let old2 = [p.mr_a.sge(16, 8).unwrap()];
    // SAFETY: the result words in A are read only after the completions are polled.
    unsafe {
        p.a.post_send(&[
            SendWr {
                wr_id: 1,
                op: WrOp::FetchAdd {
                    remote_addr: word,
                    rkey: rk,
                    add: 5,
                },
                sg_list: &old0,
                flags: SendFlags::SIGNALED,
            },
            // compare fails (105 != 7): no swap, old value returned
            SendWr {
                wr_id: 2,
                op: WrOp::CompareSwap {
                    remote_addr: word,
                    rkey: rk,
                    compare: 7,
                    swap: 1,
                },
                sg_list: &old1,
                flags: SendFlags::SIGNALED | SendFlags::FENCE,
            },
            SendWr {
                wr_id: 3,
                op: WrOp::CompareSwap {
                    remote_addr: word,
                    rkey: rk,
                    compare: 105,
                    swap: 999,
                },
                sg_list: &old2,
                flags: SendFlags::SIGNALED | SendFlags::FENCE,
            },
        ])
        .unwrap();
    }
    let ws = poll_n(&mut p.cq_a, 3);
    let ops: Vec<_> = ws.iter().map(|w| (ok(*w).wr_id, w.opcode)).collect();
    assert_eq!(
        ops,
        [
            (1, WcOpcode::FetchAdd),
            (2, WcOpcode::CompSwap),
            (3, WcOpcode::CompSwap)
        ]
    );
    assert_eq!(
        [
            read_u64(&p.mr_a, 0),
            read_u64(&p.mr_a, 8),
            read_u64(&p.mr_a, 16)
        ],
        [100, 105, 105]
    );
    assert_eq!(read_u64(&p.mr_b, 64), 999);
    // Refused before the device: misaligned word, wrong result SGE.
    let bad = [
        (word + 4, [p.mr_a.sge(0, 8).unwrap()]),
        (word, [p.mr_a.sge(0, 4).unwrap()]),
    ];
    for (addr, sg) in &bad {
        // SAFETY: refused before anything is posted.
        let e = unsafe {
            p.a.post_send(&[SendWr {
                wr_id: 9,
                op: WrOp::FetchAdd {
                    remote_addr: *addr,
                    rkey: rk,
                    add: 1,
                },
                sg_list: sg,
                flags: SendFlags::SIGNALED,
            }])
        }
        .unwrap_err();
        assert_eq!(e.error.kind(), ErrorKind::InvalidArgument, "{e}");
    }
}

#[test]
fn bad_rkey_is_rem_access_err_then_flush() {
    let Some(mut p) = pair("bad_rkey_is_rem_access_err_then_flush") else {
        return;
    };
    let s = [p.mr_a.sge(0, 64).unwrap()];
    let bogus = p.mr_b.rkey() ^ 0x5a5a_0000;
    // SAFETY: A's source range is untouched until the completions are polled.
    unsafe {
        p.a.post_send(&[
            SendWr {
                wr_id: 1,
                op: WrOp::Write {
                    remote_addr: p.mr_b.addr(),
                    rkey: bogus,
                },
                sg_list: &s,
                flags: SendFlags::SIGNALED,
            },
            SendWr {
                wr_id: 2,
                op: WrOp::Write {
                    remote_addr: p.mr_b.addr(),
                    rkey: p.mr_b.rkey(),
                },
                sg_list: &s,
                flags: SendFlags::SIGNALED,
            },
        ])
        .unwrap();
    }
    let w = poll_one(&mut p.cq_a);
    assert_eq!((w.wr_id, w.status), (1, WcStatus::RemAccessErr), "{w:?}");
    let msg = WcError::check(&w).unwrap_err().to_string();
    assert!(
        msg.contains("IBV_WC_REM_ACCESS_ERR (10)") && msg.contains("rkey"),
        "{msg}"
    );
    println!("explained: {msg}");
    let w = poll_one(&mut p.cq_a);
    assert_eq!((w.wr_id, w.status), (2, WcStatus::WrFlushErr));
    assert_eq!(p.a.state(), QpState::Error);
    // Out of bounds with the right key is the same error.
    let Some(mut p) = pair("bad_rkey_is_rem_access_err_then_flush/bounds") else {
        return;
    };
    let s = [p.mr_a.sge(0, 64).unwrap()];
    // SAFETY: as above.
    unsafe {
        p.a.post_send(&[SendWr {
            wr_id: 3,
            op: WrOp::Read {
                remote_addr: p.mr_b.addr() + LEN as u64 - 32,
                rkey: p.mr_b.rkey(),
            },
            sg_list: &s,
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
    }
    assert_eq!(poll_one(&mut p.cq_a).status, WcStatus::RemAccessErr);
}

#[test]
fn rnr_retry_exhausted_without_receive() {
    let attr = ConnectAttr {
        rnr_retry: 0,
        min_rnr_timer: 1,
        ..ConnectAttr::default()
    };
    let Some(mut p) = pair_with(
        "rnr_retry_exhausted_without_receive",
        QpCaps::default(),
        attr,
    ) else {
        return;
    };
    let s = [p.mr_a.sge(0, 8).unwrap()];
    // SAFETY: source untouched until the completion is polled.
    unsafe {
        p.a.post_send(&[SendWr {
            wr_id: 4,
            op: WrOp::Send,
            sg_list: &s,
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
    }
    let w = poll_one(&mut p.cq_a);
    assert_eq!(w.status, WcStatus::RnrRetryExcErr, "{w:?}");
    assert!(
        WcError::check(&w)
            .unwrap_err()
            .to_string()
            .contains("no receive")
    );
}

#[test]
fn state_machine_and_post_errors() {
    let Some(ctx) = open_or_skip("state_machine_and_post_errors") else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    let mut cq = ctx.create_cq(64, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 2,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let mut qp = pd.create_qp(&cq, &cq, caps).unwrap();
    assert_eq!(qp.state(), QpState::Reset);
    let mr = pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
    let sg = [mr.sge(0, 64).unwrap()];
    // SAFETY: refused (RESET) before anything is posted.
    let e = unsafe {
        qp.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &sg,
        }])
    }
    .unwrap_err();
    assert_eq!((e.posted, e.error.kind()), (0, ErrorKind::InvalidState));
    qp.modify_to_init(Access::LOCAL_WRITE).unwrap();
    assert_eq!(qp.state(), QpState::Init);
    // SAFETY: refused (not RTS) before anything is posted.
    let e = unsafe {
        qp.post_send(&[SendWr {
            wr_id: 1,
            op: WrOp::Send,
            sg_list: &sg,
            flags: SendFlags::SIGNALED,
        }])
    }
    .unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::InvalidState);
    assert!(e.to_string().contains("before RTS"), "{e}");
    // RTS needs RTR first.
    assert_eq!(
        qp.modify_to_rts(&ConnectAttr::default())
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidState
    );
    // A receive posted in INIT, a second one with too many SGEs: the first is posted.
    let two = [mr.sge(0, 8).unwrap(), mr.sge(8, 8).unwrap()];
    // SAFETY: the posted receive's buffer stays valid until its flush completion is polled.
    let e = unsafe {
        qp.post_recv(&[
            RecvWr {
                wr_id: 1,
                sg_list: &sg,
            },
            RecvWr {
                wr_id: 2,
                sg_list: &two,
            },
        ])
    }
    .unwrap_err();
    assert_eq!((e.posted, e.error.kind()), (1, ErrorKind::InvalidArgument));
    // Endpoint checks: another provider's endpoint is refused.
    let mut ep = qp.endpoint();
    ep.provider = rpc_core::verbs::Endpoint::PROVIDER_SOFT;
    let e = qp.modify_to_rtr(&ep, &ConnectAttr::default()).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidEndpoint, "{e}");
    // ERROR flushes what is queued.
    qp.modify_to_error().unwrap();
    assert_eq!(qp.state(), QpState::Error);
    let w = poll_one(&mut cq);
    assert_eq!((w.wr_id, w.status), (1, WcStatus::WrFlushErr));
    // A receive posted in ERROR is accepted and flushed too.
    // SAFETY: the buffer stays valid until the flush completion is polled.
    unsafe {
        qp.post_recv(&[RecvWr {
            wr_id: 3,
            sg_list: &sg,
        }])
    }
    .unwrap();
    let w = poll_one(&mut cq);
    assert_eq!((w.wr_id, w.status), (3, WcStatus::WrFlushErr));
    qp.modify_to_reset().unwrap();
    assert_eq!(qp.state(), QpState::Reset);
    // Over the device's caps: refused at creation.
    let huge = QpCaps {
        max_send_wr: ctx.caps().max_qp_wr + 1,
        ..caps
    };
    assert_eq!(
        pd.create_qp(&cq, &cq, huge).unwrap_err().kind(),
        ErrorKind::ExceedsCaps
    );
    // CQ overrun is prevented by sizing: QPs are refused once their queues (as granted by
    // the device) could overflow the CQ, and a dropped QP gives its room back.
    drop(qp);
    let mut qps = Vec::new();
    let e = loop {
        match pd.create_qp(&cq, &cq, caps) {
            Ok(q) => qps.push(q),
            Err(e) => break e,
        }
        assert!(qps.len() < 1000, "no limit");
    };
    assert_eq!(e.kind(), ErrorKind::ExceedsCaps, "{e}");
    let per_qp = qps[0].caps().max_send_wr + qps[0].caps().max_recv_wr;
    assert!(qps.len() as u32 * per_qp <= cq.capacity());
    assert!((qps.len() as u32 + 1) * per_qp > cq.capacity());
    qps.pop();
    assert!(pd.create_qp(&cq, &cq, caps).is_ok(), "released on drop");
}

#[test]
fn path_mtu_is_the_minimum() {
    let attr = ConnectAttr {
        path_mtu: 600,
        ..ConnectAttr::default()
    };
    let Some(p) = pair_with("path_mtu_is_the_minimum", QpCaps::default(), attr) else {
        return;
    };
    assert_eq!(p.a.path_mtu(), 512);
    let Some(p) = pair("path_mtu_is_the_minimum/default") else {
        return;
    };
    assert_eq!(p.a.path_mtu(), p.ctx.info().active_mtu);
    assert_eq!(p.a.remote().map(|r| r.qp_num), Some(p.b.qp_num()));
}

#[test]
fn many_work_requests_cross_post_batches() {
    let Some(mut p) = pair("many_work_requests_cross_post_batches") else {
        return;
    };
    const N: usize = 50;
    let rs: Vec<[Sge; 1]> = (0..N).map(|i| [p.mr_b.sge(i * 64, 64).unwrap()]).collect();
    let rw: Vec<RecvWr<'_>> = rs
        .iter()
        .enumerate()
        .map(|(i, s)| RecvWr {
            wr_id: i as u64,
            sg_list: s,
        })
        .collect();
    for i in 0..N {
        write(&p.mr_a, i * 64, &[i as u8; 64]);
    }
    let ss: Vec<[Sge; 1]> = (0..N).map(|i| [p.mr_a.sge(i * 64, 64).unwrap()]).collect();
    let sw: Vec<SendWr<'_>> = ss
        .iter()
        .enumerate()
        .map(|(i, s)| SendWr {
            wr_id: 1000 + i as u64,
            op: WrOp::Send,
            sg_list: s,
            flags: SendFlags::SIGNALED,
        })
        .collect();
    // SAFETY: buffers in live regions, read only after their completions are polled.
    unsafe {
        p.b.post_recv(&rw).unwrap();
        p.a.post_send(&sw).unwrap();
    }
    let sent = poll_n(&mut p.cq_a, N);
    assert!(
        sent.iter()
            .enumerate()
            .all(|(i, w)| ok(*w).wr_id == 1000 + i as u64)
    );
    let got = poll_n(&mut p.cq_b, N);
    assert!(
        got.iter()
            .enumerate()
            .all(|(i, w)| ok(*w).wr_id == i as u64 && w.byte_len == 64)
    );
    for i in 0..N {
        assert_eq!(read(&p.mr_b, i * 64, 64), [i as u8; 64]);
    }
}

#[test]
fn full_send_queue_is_back_pressure() {
    let caps = QpCaps {
        max_send_wr: 4,
        ..QpCaps::default()
    };
    let Some(mut p) = pair_with(
        "full_send_queue_is_back_pressure",
        caps,
        ConnectAttr::default(),
    ) else {
        return;
    };
    let s = [p.mr_a.sge(0, 8).unwrap()];
    let wrs: Vec<SendWr<'_>> = (0..256)
        .map(|i| SendWr {
            wr_id: i,
            op: WrOp::Write {
                remote_addr: p.mr_b.addr(),
                rkey: p.mr_b.rkey(),
            },
            sg_list: &s,
            flags: SendFlags::SIGNALED,
        })
        .collect();
    // SAFETY: the source is untouched until every posted completion is polled.
    let e = unsafe { p.a.post_send(&wrs) }.unwrap_err();
    assert_eq!(e.error.kind(), ErrorKind::QueueFull, "{e}");
    assert!(e.error.is_queue_full());
    assert!(e.posted >= 4 && e.posted < 256, "{e}");
    println!("send queue of 4 took {} before back-pressure", e.posted);
    let done = poll_n(&mut p.cq_a, e.posted);
    assert!(done.iter().all(|w| w.is_ok()));
}

#[test]
fn completion_channel_wakes_the_waiter() {
    let Some(ctx) = open_or_skip("completion_channel_wakes_the_waiter") else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    let ch = ctx.create_comp_channel().unwrap();
    let mut cq = ctx.create_cq(512, Some(&ch)).unwrap();
    let mut cq_a = ctx.create_cq(512, None).unwrap();
    let mut a = pd.create_qp(&cq_a, &cq_a, QpCaps::default()).unwrap();
    let mut b = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb, &ConnectAttr::default()).unwrap();
    b.connect(&ea, &ConnectAttr::default()).unwrap();
    let mr = pd.alloc_mr(4096, Access::ALL).unwrap();
    let r = [mr.sge(0, 64).unwrap()];
    let s = [mr.sge(1024, 8).unwrap()];
    // SAFETY: buffers in a live region, read after the completions.
    unsafe {
        b.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &r,
        }])
        .unwrap()
    };
    assert_eq!(cq.poll(&mut [Wc::default(); 4]).unwrap(), 0);
    cq.req_notify(false).unwrap();
    let t = Instant::now();
    assert!(
        !ch.wait(Some(Duration::from_millis(50))).unwrap(),
        "nothing happened yet"
    );
    assert!(t.elapsed() >= Duration::from_millis(45));
    // SAFETY: as above.
    unsafe {
        a.post_send(&[SendWr {
            wr_id: 2,
            op: WrOp::Send,
            sg_list: &s,
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
    }
    assert!(
        ch.wait(Some(WAIT)).unwrap(),
        "the receive completion raised no event"
    );
    assert_eq!(ok(poll_one(&mut cq)).wr_id, 1);
    ok(poll_one(&mut cq_a));
    assert_eq!(ch.drain().unwrap(), 0);
    // A CQ without a channel cannot be armed.
    assert_eq!(
        cq_a.req_notify(false).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
}

#[test]
fn registration_rules() {
    let Some(ctx) = open_or_skip("registration_rules") else {
        return;
    };
    let pd = ctx.alloc_pd().unwrap();
    assert_eq!(
        pd.alloc_mr(0, Access::ALL).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    assert_eq!(
        pd.alloc_mr(64, Access::REMOTE_WRITE).unwrap_err().kind(),
        ErrorKind::InvalidArgument
    );
    let mr = pd.alloc_mr(10_000, Access::ALL).unwrap();
    assert_eq!(mr.len(), 10_000);
    assert_eq!(mr.addr() % 4096, 0, "page aligned");
    assert!(read(&mr, 0, 10_000).iter().all(|&b| b == 0), "zeroed");
    let mut own = vec![1u8; 8192];
    // SAFETY: `own` outlives the region (dropped after it) and no work request uses it.
    let r = unsafe { pd.reg_mr(own.as_mut_ptr(), own.len(), Access::LOCAL_WRITE) }.unwrap();
    assert_eq!(r.len(), 8192);
    assert_ne!(r.lkey(), mr.lkey());
    drop(r);
    // SAFETY: a null range is refused before the driver sees it.
    let e = unsafe { pd.reg_mr(std::ptr::null_mut(), 64, Access::LOCAL_WRITE) }.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidArgument);
}

#[test]
fn rails_follow_the_hca_order() {
    let Some(first) = open_or_skip("rails_follow_the_hca_order") else {
        return;
    };
    drop(first);
    let names: Vec<String> = Ib::devices().unwrap().into_iter().map(|d| d.name).collect();
    let mut want: Vec<String> = names.clone();
    want.reverse();
    let spec = HcaSpec::parse(&format!("={}", want.join(","))).unwrap();
    let rails = Ib::open_spec(&spec, None).unwrap();
    let got: Vec<&str> = rails.iter().map(|c| c.info().name.as_str()).collect();
    assert_eq!(got, want);
    for (i, r) in rails.iter().enumerate() {
        assert_eq!(r.rail(), i);
    }
    assert_eq!(rail_of(5, rails.len()), 5 % rails.len());
    if let Ok(devs) = std::env::var("SOFTROCE_DEVICES") {
        assert_eq!(
            names.len(),
            devs.split_whitespace().count(),
            "{names:?} vs {devs}"
        );
    }
    // Every rail works on its own: a loopback SEND on each.
    for ctx in &rails {
        let pd = ctx.alloc_pd().unwrap();
        let mut cq = ctx.create_cq(512, None).unwrap();
        let mut a = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        let mut b = pd.create_qp(&cq, &cq, QpCaps::default()).unwrap();
        let (ea, eb) = (a.endpoint(), b.endpoint());
        a.connect(&eb, &ConnectAttr::default()).unwrap();
        b.connect(&ea, &ConnectAttr::default()).unwrap();
        let mr = pd.alloc_mr(4096, Access::LOCAL_WRITE).unwrap();
        write(&mr, 0, ctx.info().name.as_bytes());
        let s = [mr.sge(0, ctx.info().name.len() as u32).unwrap()];
        let r = [mr.sge(2048, 64).unwrap()];
        // SAFETY: buffers in a live region, read after the completions.
        unsafe {
            b.post_recv(&[RecvWr {
                wr_id: 1,
                sg_list: &r,
            }])
            .unwrap();
            a.post_send(&[SendWr {
                wr_id: 2,
                op: WrOp::Send,
                sg_list: &s,
                flags: SendFlags::SIGNALED,
            }])
            .unwrap();
        }
        let ws = poll_n(&mut cq, 2);
        assert!(ws.iter().all(|w| w.is_ok()), "{ws:?}");
        assert_eq!(
            read(&mr, 2048, s[0].length as usize),
            ctx.info().name.as_bytes()
        );
    }
}

#[test]
fn qp_group_stripes_one_connection() {
    let Some(ctx) = open_or_skip("qp_group_stripes_one_connection") else {
        return;
    };
    assert_eq!(
        <Ib as Provider>::qps_per_connection().unwrap(),
        1,
        "default"
    );
    let pd = ctx.alloc_pd().unwrap();
    let mut cq_a = ctx.create_cq(256, None).unwrap();
    let mut cq_b = ctx.create_cq(256, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 16,
        max_recv_wr: 16,
        ..QpCaps::default()
    };
    let mut ga = QpGroup::<Ib>::create(&pd, &cq_a, &cq_a, caps, 4).unwrap();
    let mut gb = QpGroup::<Ib>::create(&pd, &cq_b, &cq_b, caps, 4).unwrap();
    let (ea, eb) = (ga.endpoints(), gb.endpoints());
    assert_eq!(
        ga.connect(&eb[..3], &ConnectAttr::default())
            .unwrap_err()
            .kind(),
        ErrorKind::InvalidEndpoint
    );
    ga.connect(&eb, &ConnectAttr::default()).unwrap();
    gb.connect(&ea, &ConnectAttr::default()).unwrap();
    let mr = pd.alloc_mr(LEN, Access::ALL).unwrap();
    let rs: Vec<[Sge; 1]> = (0..8)
        .map(|i| [mr.sge(32_768 + i * 64, 64).unwrap()])
        .collect();
    for (i, qp) in gb.iter_mut().enumerate() {
        // SAFETY: buffers in a live region, read after the completions.
        unsafe {
            qp.post_recv(&[
                RecvWr {
                    wr_id: (i * 2) as u64,
                    sg_list: &rs[i * 2],
                },
                RecvWr {
                    wr_id: (i * 2 + 1) as u64,
                    sg_list: &rs[i * 2 + 1],
                },
            ])
            .unwrap();
        }
    }
    for k in 0..8u64 {
        write(&mr, k as usize * 8, &k.to_ne_bytes());
        let s = [mr.sge(k as usize * 8, 8).unwrap()];
        let (i, qp) = ga.next_qp();
        assert_eq!(i, k as usize % 4);
        // SAFETY: source untouched until the completions are polled.
        unsafe {
            qp.post_send(&[SendWr {
                wr_id: k,
                op: WrOp::Send,
                sg_list: &s,
                flags: SendFlags::SIGNALED,
            }])
            .unwrap();
        }
    }
    assert!(poll_n(&mut cq_a, 8).iter().all(|w| w.is_ok()));
    let got = poll_n(&mut cq_b, 8);
    let mut per_qp = [0; 4];
    for w in &got {
        let i = gb
            .index_of(ok(*w).qp_num)
            .expect("completion of a group QP");
        per_qp[i] += 1;
    }
    assert_eq!(per_qp, [2, 2, 2, 2], "striped round-robin");
}

/// Run with `RPC_IB_HCA` and/or `RPC_IB_GID_INDEX` set (softroce/ci.sh does, in the VM), this
/// checks that `open(None)` follows them; without them it checks the defaults.
#[test]
fn env_overrides_apply() {
    let Some(ctx) = open_or_skip("env_overrides_apply") else {
        return;
    };
    match std::env::var("RPC_IB_HCA") {
        Ok(v) => {
            let spec = HcaSpec::parse(&v).unwrap();
            let first = &spec.entries[0];
            assert!(
                ctx.info().name.starts_with(first.name.as_str()),
                "{v} -> {ctx:?}"
            );
            assert_eq!(ctx.rail(), 0);
        }
        Err(_) => assert_eq!(ctx.info().name, Ib::devices().unwrap()[0].name),
    }
    match std::env::var("RPC_IB_GID_INDEX") {
        Ok(v) => {
            assert_eq!(ctx.gid().index.to_string(), v.trim());
            assert_eq!(ctx.gid_choice(), GidChoice::Forced);
        }
        Err(_) if ctx.info().link_layer == LinkLayer::Ethernet => {
            assert_eq!(ctx.gid_choice(), GidChoice::Auto);
        }
        Err(_) => assert_eq!(ctx.gid_choice(), GidChoice::InfiniBand),
    }
    // Whatever was chosen must carry traffic: one SEND on that GID.
    let Some(mut p) = pair("env_overrides_apply/traffic") else {
        return;
    };
    write(&p.mr_a, 0, b"gid");
    let r = [p.mr_b.sge(0, 16).unwrap()];
    let s = [p.mr_a.sge(0, 3).unwrap()];
    // SAFETY: buffers in live regions, read after the completions.
    unsafe {
        p.b.post_recv(&[RecvWr {
            wr_id: 1,
            sg_list: &r,
        }])
        .unwrap();
        p.a.post_send(&[SendWr {
            wr_id: 2,
            op: WrOp::Send,
            sg_list: &s,
            flags: SendFlags::SIGNALED,
        }])
        .unwrap();
    }
    ok(poll_one(&mut p.cq_a));
    assert_eq!(ok(poll_one(&mut p.cq_b)).byte_len, 3);
    println!("env_overrides_apply: {ctx:?}");
}
