//! The CQ a process's thread-polled channels share ([`super::hub`]): every answer reaches its
//! own caller whoever polls it (the poller thread, or a blocking caller driving its own
//! connection, which routes the others'), channels come and go while others call, and a
//! channel that does not fit the shared CQ makes one of its own.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::rogue_tests::Blob;
use crate::client::{Channel, ClientPoller};
use crate::verbs::soft::Soft;
use crate::{Request, verbs::Cq as _};

use super::window_tests::{BLOB, Num, call, connect, server, slow_calls, soft_core};
use super::{ClientCore, Cqs, Hub};

/// The hub a connection's seat is on (`None`: a CQ of its own).
fn hub_of(core: &ClientCore<Soft>) -> Option<Arc<Hub<Soft>>> {
    let start = Instant::now();
    loop {
        // The poller thread may hold the driver this instant.
        if let Some(d) = core.driver.try_lock() {
            return match &d.cqs {
                Cqs::Shared(seat) => Some(Arc::clone(seat.hub())),
                Cqs::Own(cq) => {
                    assert!(cq.capacity() > 0);
                    None
                }
            };
        }
        assert!(start.elapsed() < Duration::from_secs(10), "driver held");
        std::thread::yield_now();
    }
}

/// `n` blocking calls on `ch` from a thread of its own, each checked.
fn blocking_calls(ch: Channel, tag: u64, n: u64) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for k in 0..n {
            let seq = 64 << 32 | tag << 16 | k;
            let mut req = Request::new(Num { seq });
            req.set_timeout(Duration::from_secs(30));
            let r: Blob = ch
                .unary_blocking::<Num, Blob>(&BLOB, req)
                .unwrap_or_else(|s| panic!("blocking call {seq:#x}: {s}"))
                .into_inner();
            assert_eq!(r.seq, seq);
            assert_eq!(r.data.len(), 64);
            assert!(r.data.iter().all(|&b| b == seq as u8));
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thread_polled_channels_share_one_cq_and_each_answer_reaches_its_caller() {
    let (_server, addr) = server().await;
    let mut chans = Vec::new();
    for _ in 0..12 {
        chans.push(connect(&addr, ClientPoller::Thread).await);
    }
    let Some(first) = soft_core(&chans[0]) else {
        println!("skipped: the test looks into the soft provider's connections");
        return;
    };
    let hub = hub_of(&first).expect("a thread-polled channel is on the shared CQ");
    for ch in &chans {
        let core = soft_core(ch).unwrap();
        assert!(core.channel.is_none(), "no completion channel of its own");
        assert!(Arc::ptr_eq(&hub_of(&core).unwrap(), &hub), "one hub");
    }
    assert!(hub.members() >= 12);
    // A caller-polled channel keeps a CQ of its own.
    let caller = connect(&addr, ClientPoller::Caller).await;
    let caller_core = soft_core(&caller).unwrap();
    assert!(hub_of(&caller_core).is_none() && caller_core.channel.is_some());

    // Bursts of slow calls on every channel at once, while blocking callers on half of them
    // drive their own connections (and route the others' completions).
    let threads: Vec<_> = chans
        .iter()
        .step_by(2)
        .enumerate()
        .map(|(i, ch)| blocking_calls(ch.clone(), i as u64, 300))
        .collect();
    let bursts = chans
        .iter()
        .enumerate()
        .map(|(i, ch)| slow_calls(ch, i as u32 * 100, 24, 512));
    futures_util::future::join_all(bursts).await;
    for t in threads {
        tokio::task::spawn_blocking(move || t.join().expect("blocking caller"))
            .await
            .unwrap();
    }

    // Half the channels go, the rest keep calling; the connections gone leave the hub (their
    // cores, which hold their seats, are dropped). Other tests of this process may join and
    // leave the same hub meanwhile: their members are not counted here.
    let gone: Vec<_> = chans[6..]
        .iter()
        .map(|ch| Arc::downgrade(&soft_core(ch).unwrap()))
        .collect();
    chans.truncate(6);
    let start = Instant::now();
    while gone.iter().any(|w| w.strong_count() > 0) {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "connections still held: {}",
            gone.iter().filter(|w| w.strong_count() > 0).count()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let threads: Vec<_> = chans
        .iter()
        .enumerate()
        .map(|(i, ch)| blocking_calls(ch.clone(), 100 + i as u64, 100))
        .collect();
    let bursts = chans
        .iter()
        .enumerate()
        .map(|(i, ch)| slow_calls(ch, 5000 + i as u32 * 100, 24, 0));
    futures_util::future::join_all(bursts).await;
    for t in threads {
        tokio::task::spawn_blocking(move || t.join().expect("blocking caller"))
            .await
            .unwrap();
    }

    // A CQ that cannot grow (the device's max_cqe reached): new channels join while there is
    // room, then make a CQ of their own, and work all the same.
    hub.stop_growing();
    let mut joined = Vec::new();
    let own = loop {
        assert!(
            joined.len() < 200,
            "room never ran out: {:?}",
            hub.cq_room()
        );
        let ch = connect(&addr, ClientPoller::Thread).await;
        let core = soft_core(&ch).unwrap();
        if hub_of(&core).is_none() {
            assert!(core.channel.is_some(), "a completion channel of its own");
            break ch;
        }
        joined.push(ch);
    };
    hub.grow_up_to(u32::MAX);
    let t = blocking_calls(own.clone(), 999, 100);
    slow_calls(&own, 9000, 24, 256).await;
    for (i, ch) in joined.iter().enumerate() {
        call(ch.clone(), (16 << 32) | (20_000 + i as u64)).await;
    }
    tokio::task::spawn_blocking(move || t.join().expect("blocking caller"))
        .await
        .unwrap();
}
