//! The protocol core allocates nothing per frame: a counting global allocator watches steady
//! state unary and streaming traffic (build, encode, decode, handle, finish, deadlines,
//! credit updates) between a client and a server `Conn` and must see zero allocations.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use rpc_core::CallKind;
use rpc_core::wire::{Config, Conn, Event, FrameHeader, MAX_HEADER_LEN, Role, decode};

struct Counting;

thread_local! {
    /// Allocations made by this thread while counting is on (the test harness's other
    /// threads are not ours to count).
    static COUNT: Cell<Option<u64>> = const { Cell::new(None) };
}

fn note() {
    // `try_with`: the thread-local may already be gone while a thread shuts down.
    let _ = COUNT.try_with(|c| {
        if let Some(n) = c.get() {
            c.set(Some(n + 1));
        }
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged, so
// `System`'s guarantees are ours; the counter only touches a const-initialised thread-local
// `Cell`, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: same contract as ours (`layout` has non-zero size, checked by our caller).
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System.alloc*` with `layout` (all our allocations do).
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: `ptr`/`layout` came from `System` (above); `new_size` as our caller gave it.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// A fixed-size receive slot, as the runtime has.
type Slot = [u8; 512];

/// Encodes `h` with `payload` into `slot`, then decodes and hands it to `to`, then re-posts.
fn transfer(h: &FrameHeader, payload: &[u8], slot: &mut Slot, to: &mut Conn, now: u64) -> Event {
    let n = h.encode(slot).expect("encode");
    slot[n..n + payload.len()].copy_from_slice(payload);
    let f = decode(slot).expect("decode");
    assert_eq!(f.payload, payload);
    let ev = to.handle_frame(&f.header, now).expect("handle");
    to.recv_reposted(1).expect("repost");
    ev
}

fn round_trips(c: &mut Conn, s: &mut Conn, slot: &mut Slot, now: &mut u64, n: u32) {
    let method = 0xfeed;
    for i in 0..n {
        *now += 1_000;
        // Unary with a deadline.
        let call = c
            .start_call(method, CallKind::Unary, Some(1_000_000), *now)
            .expect("start");
        let h = c.request(call, 32, 0, None, None, *now).expect("request");
        let ev = transfer(&h, &[i as u8; 32], slot, s, *now);
        assert!(matches!(ev, Event::Request { call: sc, .. } if sc == call));
        let h = s.response(call, 32, 0, None, false).expect("response");
        let ev = transfer(&h, &[1; 32], slot, c, *now);
        assert!(matches!(ev, Event::Response { .. }));
        assert!(c.finish(call) && s.finish(call));

        // A short server stream with window updates.
        let call = c
            .start_call(method, CallKind::ServerStreaming, None, *now)
            .expect("start");
        let h = c.request(call, 4, 0, None, None, *now).expect("request");
        transfer(&h, b"strm", slot, s, *now);
        for _ in 0..2 {
            let h = s.stream_message(call, 8, 0, None).expect("message");
            transfer(&h, &[2; 8], slot, c, *now);
        }
        let h = c.window_update(call, 2).expect("window");
        transfer(&h, &[], slot, s, *now);
        let h = s.status(call, 0, 0, 0).expect("status");
        transfer(&h, &[], slot, c, *now);
        assert!(c.finish(call) && s.finish(call));

        // A call that times out.
        let call = c
            .start_call(method, CallKind::Unary, Some(10), *now)
            .expect("start");
        assert_eq!(c.poll_timeout(), Some(*now + 10));
        assert_eq!(c.expire(*now + 10), Some(call));
        assert!(c.finish(call));

        if c.wants_credit_update() {
            let h = c.credit_update().expect("credit update");
            transfer(&h, &[], slot, s, *now);
        }
        if s.wants_credit_update() {
            let h = s.credit_update().expect("credit update");
            transfer(&h, &[], slot, c, *now);
        }
    }
}

#[test]
fn no_allocation_per_frame_in_steady_state() {
    let cfg = Config::default();
    let mut c = Conn::new(Role::Client, cfg).unwrap();
    let mut s = Conn::new(Role::Server, cfg).unwrap();
    let mut slot: Slot = [0; 512];
    assert!(slot.len() > MAX_HEADER_LEN + 32);
    let mut now = 0;
    // Warm up (nothing should allocate here either, but only steady state is promised).
    round_trips(&mut c, &mut s, &mut slot, &mut now, 100);

    COUNT.with(|n| n.set(Some(0)));
    round_trips(&mut c, &mut s, &mut slot, &mut now, 10_000);
    let allocations = COUNT.with(|n| n.replace(None)).unwrap();
    assert_eq!(
        allocations, 0,
        "allocations in 10,000 iterations of 7 frames and an expiry each"
    );

    // The counter works: a Conn makes its tables (free list in `new`; call table and
    // deadlines as its first call uses them).
    COUNT.with(|n| n.set(Some(0)));
    let mut extra = Conn::new(Role::Client, cfg).unwrap();
    extra
        .start_call(0xfeed, CallKind::Unary, Some(1_000), now)
        .expect("start");
    let allocations = COUNT.with(|n| n.replace(None)).unwrap();
    drop(extra);
    assert!(
        allocations >= 5,
        "a connection's tables are allocated by its first call ({allocations})"
    );
}
