//! The soft provider's fast path allocates nothing: `post_send` (every opcode, inline or not,
//! queued for RNR and retried), `post_recv`, `poll` and `req_notify` are counted by a global
//! allocator while they run, after a warm-up (the first access to a peer's region maps it).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use rpc_core::verbs::soft::Soft;
use rpc_core::verbs::{
    Access, ConnectAttr, Context, Cq, Mr, Pd, Provider, Qp, QpCaps, RecvWr, SendFlags, SendWr, Wc,
    WcStatus, WrOp,
};

struct Counting;

static ALLOCS: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

fn note() {
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
    }
}

// SAFETY: forwards to the system allocator unchanged; only counts calls.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: forwarded contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded contract.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn poll_exact<C: Cq>(cq: &mut C, n: usize) {
    let mut wcs = [Wc::default(); 16];
    let mut got = 0;
    let t0 = Instant::now();
    while got < n {
        let k = cq.poll(&mut wcs[..(n - got).min(16)]).unwrap();
        for wc in &wcs[..k] {
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
        }
        got += k;
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out");
    }
}

#[test]
fn fast_path_does_not_allocate() {
    // The counter sees allocations made while counting (so a zero below means something).
    let before = ALLOCS.load(Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    let probe = std::hint::black_box(Box::new(1u64));
    COUNTING.with(|c| c.set(false));
    drop(probe);
    assert_eq!(ALLOCS.load(Ordering::Relaxed) - before, 1);

    let a_ctx = Soft::open(None).unwrap();
    let b_ctx = Soft::open(None).unwrap();
    let ch = a_ctx.create_comp_channel().unwrap();
    let (a_pd, b_pd) = (a_ctx.alloc_pd().unwrap(), b_ctx.alloc_pd().unwrap());
    let mut a_cq = a_ctx.create_cq(512, Some(&ch)).unwrap();
    let mut b_cq = b_ctx.create_cq(512, None).unwrap();
    let caps = QpCaps {
        max_send_wr: 64,
        max_recv_wr: 64,
        max_send_sge: 4,
        max_recv_sge: 4,
        max_inline_data: 128,
    };
    let attr = ConnectAttr {
        min_rnr_timer: 1,
        ..ConnectAttr::default()
    };
    let mut a = a_pd.create_qp(&a_cq, &a_cq, caps).unwrap();
    let mut b = b_pd.create_qp(&b_cq, &b_cq, caps).unwrap();
    a.modify_to_init(attr.access).unwrap();
    b.modify_to_init(attr.access).unwrap();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb, &attr).unwrap();
    b.connect(&ea, &attr).unwrap();
    let src = a_pd.alloc_mr(1 << 16, Access::ALL).unwrap();
    let dst = b_pd.alloc_mr(1 << 16, Access::ALL).unwrap();
    let r = dst.remote();
    let s1 = [src.sge(0, 100).unwrap(), src.sge(4096, 900).unwrap()];
    let s8 = [src.sge(8192, 8).unwrap()];
    let recv_sge = [dst.sge(16384, 4096).unwrap()];
    let recvs = [RecvWr {
        wr_id: 7,
        sg_list: &recv_sge,
    }; 3];
    let sig = SendFlags::SIGNALED;
    let wrs = [
        SendWr {
            wr_id: 1,
            op: WrOp::Send,
            sg_list: &s1,
            flags: sig,
        },
        SendWr {
            wr_id: 2,
            op: WrOp::SendWithImm { imm: 5 },
            sg_list: &s8,
            flags: sig | SendFlags::INLINE,
        },
        SendWr {
            wr_id: 3,
            op: WrOp::Write {
                remote_addr: r.addr,
                rkey: r.rkey,
            },
            sg_list: &s1,
            flags: SendFlags::NONE,
        },
        SendWr {
            wr_id: 4,
            op: WrOp::WriteWithImm {
                remote_addr: r.addr + 2048,
                rkey: r.rkey,
                imm: 6,
            },
            sg_list: &s1,
            flags: sig,
        },
        SendWr {
            wr_id: 5,
            op: WrOp::Read {
                remote_addr: r.addr,
                rkey: r.rkey,
            },
            sg_list: &s1,
            flags: sig,
        },
        SendWr {
            wr_id: 6,
            op: WrOp::FetchAdd {
                remote_addr: r.addr + 8192,
                rkey: r.rkey,
                add: 1,
            },
            sg_list: &s8,
            flags: sig,
        },
        SendWr {
            wr_id: 8,
            op: WrOp::CompareSwap {
                remote_addr: r.addr + 8192,
                rkey: r.rkey,
                compare: 0,
                swap: 1,
            },
            sg_list: &s8,
            flags: sig,
        },
    ];
    let round = |a: &mut <Soft as Provider>::Qp,
                 b: &mut <Soft as Provider>::Qp,
                 a_cq: &mut <Soft as Provider>::Cq,
                 b_cq: &mut <Soft as Provider>::Cq| {
        // SAFETY: the regions outlive every completion, polled below.
        unsafe {
            b.post_recv(&recvs).unwrap();
            a.post_send(&wrs).unwrap();
        }
        poll_exact(a_cq, 6); // 6 signaled
        poll_exact(b_cq, 3); // SEND, SEND_WITH_IMM, WRITE_WITH_IMM
        // RNR path: a SEND with no receive is queued, then retried by poll once one is posted.
        // SAFETY: as above.
        unsafe { a.post_send(&wrs[..1]).unwrap() };
        std::thread::sleep(Duration::from_micros(20));
        // SAFETY: as above.
        unsafe { b.post_recv(&recvs[..1]).unwrap() };
        poll_exact(a_cq, 1);
        poll_exact(b_cq, 1);
        a_cq.req_notify(false).unwrap();
    };
    // Warm-up: maps the peer's regions, takes the slow paths once.
    for _ in 0..3 {
        round(&mut a, &mut b, &mut a_cq, &mut b_cq);
    }
    let before = ALLOCS.load(Ordering::Relaxed);
    COUNTING.with(|c| c.set(true));
    for _ in 0..200 {
        round(&mut a, &mut b, &mut a_cq, &mut b_cq);
    }
    COUNTING.with(|c| c.set(false));
    let n = ALLOCS.load(Ordering::Relaxed) - before;
    assert_eq!(n, 0, "{n} heap allocations on the fast path");
    assert!(
        a_ctx.counters().rnr_retries > 0,
        "the RNR path was exercised"
    );
}
