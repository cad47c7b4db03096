//! Faults on the wire between two hosts (`softroce/vm.sh pair`: two VMs, rxe0 on a virtio NIC
//! each, joined by a virtual cable): `tc netem` loss, reordering and delay on the client's NIC,
//! the link taken down for 2 s, and for good. Every test here changes the host's network, so
//! all are ignored entries that `softroce/ci.sh` runs in the client VM (with
//! `RPC_TEST_REMOTE` naming this binary's `serve_for_the_pair` in the server VM and
//! `SOFTROCE_NETDEV` the NIC to disturb); `cargo test` alone runs none of them.
//!
//! Netem shapes the client VM's egress only: requests, the client's READ responses and its
//! ACKs. Every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use rpc_core::{Channel, ClientPoller, Code, Request, Response, Status};

const SERVER: Slot = Slot {
    offset: 0,
    config: |b| b,
};

/// The server side of a two-host run, until stdin closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the server side of a two-host run (softroce/vm.sh pair sets RPC_TEST_SERVE)"]
async fn serve_for_the_pair() {
    serve_lab(&[SERVER]).await;
}

/// The NIC whose traffic the tests disturb.
fn netdev() -> String {
    std::env::var("SOFTROCE_NETDEV").unwrap_or_else(|_| "eth0".into())
}

/// Runs `prog args` (bounded: killed after 10 s), panicking with its output when it fails.
/// iproute2's `ip` and `tc` by absolute path: busybox has applets of both names (which lack
/// netem), and its `timeout` would run those.
fn sh(prog: &str, args: &[&str]) {
    let path = ["/sbin", "/bin", "/usr/sbin", "/usr/bin"]
        .iter()
        .map(|d| format!("{d}/{prog}"))
        .find(|p| std::path::Path::new(p).exists())
        .unwrap_or_else(|| panic!("{prog} is not installed"));
    let mut child = Command::new(&path)
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            panic!("{path} {}: no result within 10 s", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = child.wait_with_output().expect("output");
    assert!(
        out.status.success(),
        "{path} {}: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Sets the client NIC's root qdisc to netem with `args`, or removes it (`None`).
fn netem(args: Option<&str>) {
    let dev = netdev();
    match args {
        Some(a) => {
            let mut v = vec!["qdisc", "replace", "dev", dev.as_str(), "root", "netem"];
            v.extend(a.split_whitespace());
            sh("tc", &v);
        }
        None => {
            // Fails when there is none: fine.
            let _ = Command::new("/sbin/tc")
                .args(["qdisc", "del", "dev", &dev, "root"])
                .output();
        }
    }
}

fn link(up: bool) {
    sh(
        "ip",
        &["link", "set", &netdev(), if up { "up" } else { "down" }],
    );
}

/// Waits (bounded) until rxe0's IPv4-mapped GID is back after the link came up.
fn wait_gid() {
    let start = Instant::now();
    loop {
        let g = std::fs::read_to_string("/sys/class/infiniband/rxe0/ports/1/gids/1")
            .unwrap_or_default();
        if g.contains("ffff") {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "rxe0 has no IPv4 GID 20 s after the link came up ({g:?})"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Puts the network back (netem off, link up) when a test ends, even by a panic, so that the
/// next test and `vm.sh pair`'s end-of-run message still get through.
struct Restore;

impl Drop for Restore {
    fn drop(&mut self) {
        netem(None);
        let _ = Command::new("/bin/ip")
            .args(["link", "set", &netdev(), "up"])
            .output();
    }
}

/// The server's address, with the network as it should be (a test before may have left the
/// link just back up); `None` (and a note) without `RPC_TEST_REMOTE`.
fn remote_or_skip() -> Option<String> {
    let addr = remote::remote_addr(&SERVER);
    if addr.is_none() {
        eprintln!("skipping: RPC_TEST_REMOTE is not set (this test runs between two VMs)");
        return None;
    }
    netem(None);
    link(true);
    wait_gid();
    addr
}

async fn echo(ch: &Channel, seq: u64, n: usize, hint: bool) -> Result<(), Status> {
    let mut req = Request::new(Blob {
        seq,
        data: pattern(n, seq),
    });
    req.set_timeout(Duration::from_secs(30));
    if hint {
        req.set_response_size_hint(n + 32);
    }
    let r: Response<Blob> = within(CALL_LIMIT, "echo", ch.unary(&lab_server::ECHO, req)).await?;
    check_blob(r.get_ref(), seq, n, "echo");
    Ok(())
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Small calls and bulk calls under each netem setting: every call succeeds (RC retransmits
/// what netem drops or reorders) and the figures are printed as a table (lines `NETEM |`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes the host's network: run between two VMs by softroce/ci.sh"]
async fn netem_figures() {
    let Some(addr) = remote_or_skip() else { return };
    remote::wait_listening(&addr).await;
    let _restore = Restore;
    let ch = remote::connect(Channel::builder(addr.clone())).await;
    const SMALL: u64 = 300;
    const BULK: u64 = 8;
    const BULK_LEN: usize = 1 << 20;
    let settings: [(&str, Option<&str>); 5] = [
        ("none", None),
        ("loss 1%", Some("loss 1%")),
        ("loss 10%", Some("loss 10%")),
        ("reorder 25%", Some("delay 1ms reorder 25% 50%")),
        ("delay 1ms", Some("delay 1ms")),
    ];
    println!("NETEM | setting | small calls/s | small p50 | small p99 | bulk MB/s | failures");
    println!("NETEM | --- | --- | --- | --- | --- | ---");
    let mut failures = Vec::new();
    for (i, (label, args)) in settings.into_iter().enumerate() {
        netem(args);
        let mut lat = Vec::new();
        let mut failed = 0u64;
        let t0 = Instant::now();
        for k in 0..SMALL {
            let seq = i as u64 * 10_000 + k;
            let t = Instant::now();
            match echo(&ch, seq, 100, false).await {
                Ok(()) => lat.push(t.elapsed()),
                Err(e) => {
                    failed += 1;
                    failures.push(format!("{label}: small call {seq}: {e}"));
                }
            }
        }
        let small_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        for k in 0..BULK {
            let seq = i as u64 * 10_000 + 5_000 + k;
            if let Err(e) = echo(&ch, seq, BULK_LEN, k % 2 == 0).await {
                failed += 1;
                failures.push(format!("{label}: bulk call {seq}: {e}"));
            }
        }
        // An echo moves the payload both ways.
        let bulk_mb = (2 * BULK as usize * BULK_LEN) as f64 / 1e6 / t1.elapsed().as_secs_f64();
        lat.sort();
        let (p50, p99) = if lat.is_empty() {
            (Duration::ZERO, Duration::ZERO)
        } else {
            (percentile(&lat, 0.5), percentile(&lat, 0.99))
        };
        println!(
            "NETEM | {label} | {:.0} | {:.2} ms | {:.2} ms | {bulk_mb:.1} | {failed} of {}",
            lat.len() as f64 / small_s,
            p50.as_secs_f64() * 1e3,
            p99.as_secs_f64() * 1e3,
            SMALL + BULK
        );
    }
    netem(None);
    assert!(failures.is_empty(), "calls failed: {failures:#?}");
    assert!(ch.is_connected(), "the connection survived every setting");
}

/// Whether a status names the transport failure and its likely causes: the failed completion
/// (rxe completes a SEND it cannot route with LOC_QP_OP_ERR, a peer that stops answering gives
/// RETRY_EXC_ERR; later work is flushed, WR_FLUSH_ERR) and the list of culprits: link, MTU,
/// GID, PFC.
#[track_caller]
fn assert_names_cause(st: &Status, what: &str) {
    assert_eq!(st.code(), Code::Unavailable, "{what}: {st}");
    let m = st.message();
    let status = ["RETRY_EXC_ERR", "LOC_QP_OP_ERR", "WR_FLUSH_ERR"]
        .iter()
        .any(|k| m.contains(k));
    assert!(status, "{what}: the status names no completion error: {m}");
    if !m.contains("WR_FLUSH_ERR") {
        for k in ["link", "MTU", "GID", "PFC"] {
            assert!(m.contains(k), "{what}: the status does not name {k}: {m}");
        }
    }
}

/// Calls in flight when the link goes down: `n` calls whose handler takes 3 s (some with
/// large requests or responses), and a caller that keeps issuing small calls. Each ends
/// within `limit` of the link going down; returns their results and when it went down.
///
/// The steady caller matters: a call whose request was delivered leaves nothing on the
/// client's send queue, and an idle RC QP notices no broken path (no ACK is missing); the
/// next SEND's retries run out (`RETRY_EXC_ERR`) and the connection fails with every call on
/// it. So the steady caller does not wait long for a call before it starts the next.
/// Without traffic keepalive ends them (see `link_down_for_good`'s quiet connections).
async fn calls_across_link_down(
    ch: &Channel,
    n: u64,
    limit: Duration,
) -> (Vec<Result<(), Status>>, Instant) {
    let mut set = tokio::task::JoinSet::new();
    for seq in 0..n {
        let ch = ch.clone();
        set.spawn(async move {
            let mut req = Request::new(SleepRequest {
                seq,
                ms: 3_000,
                reply_len: if seq % 2 == 0 { 0 } else { 256 << 10 },
                pad: pattern(if seq % 3 == 0 { 128 << 10 } else { 10 }, seq),
            });
            req.set_timeout(Duration::from_secs(30));
            let r: Result<Response<Blob>, Status> = ch.unary(&lab_server::SLEEP, req).await;
            r.map(|_| ())
        });
    }
    let steady = ch.clone();
    set.spawn(async move {
        let start = Instant::now();
        let mut seq = 1_000;
        // One echo at a time, 50 ms apart, as long as each answers; one that has no answer
        // after 200 ms (a round trip takes a few ms) is left running and the next starts:
        // an echo whose request was delivered just before the link went down waits for a
        // response that never comes and posts nothing, and a caller that waited for it would
        // post no SEND to fail either (the calls would wait for keepalive, 31 s). Not one
        // echo every 50 ms regardless: those would pile up and take the connection's credits
        // while the link is down, and a frame waiting for a credit posts nothing either.
        let mut echoes = tokio::task::JoinSet::new();
        loop {
            seq += 1;
            let ch = steady.clone();
            echoes.spawn(async move { echo(&ch, seq, 100, false).await });
            if let Ok(Some(r)) =
                tokio::time::timeout(Duration::from_millis(200), echoes.join_next()).await
            {
                r.expect("an echo task")?;
            }
            while let Some(r) = echoes.try_join_next() {
                r.expect("an echo task")?;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the steady caller never failed"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    link(false);
    let down = Instant::now();
    let mut out = Vec::new();
    while let Some(r) = within(
        limit + Duration::from_secs(5),
        "calls in flight",
        set.join_next(),
    )
    .await
    {
        out.push(r.unwrap());
    }
    let took = down.elapsed();
    assert!(
        took < limit,
        "the calls in flight took {took:?} to fail after the link went down (limit {limit:?})"
    );
    (out, down)
}

/// How long calls in flight may take to fail once the link is down: the QP's retries
/// (`retry_cnt` 7 x 67 ms ACK timeout, under 1 s on rxe) plus the client noticing, with room
/// for the emulated VM.
const FAIL_LIMIT: Duration = Duration::from_secs(8);

/// The link goes down for 2 s: the calls in flight fail UNAVAILABLE naming the cause, within
/// the limit; once the link is back a call reconnects and succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes the host's network: run between two VMs by softroce/ci.sh"]
async fn link_flap() {
    let Some(addr) = remote_or_skip() else { return };
    remote::wait_listening(&addr).await;
    let _restore = Restore;
    let ch = remote::connect(Channel::builder(addr.clone()).poller(ClientPoller::Thread)).await;
    echo(&ch, 1, 100, false)
        .await
        .expect("a call before the flap");
    let (results, down) = calls_across_link_down(&ch, 6, FAIL_LIMIT).await;
    let failed_after = down.elapsed();
    for (i, r) in results.iter().enumerate() {
        let st = r
            .as_ref()
            .expect_err("a call in flight while the link was down");
        assert_names_cause(st, &format!("call {i} in flight"));
    }
    println!(
        "LINK | 2 s flap | {} calls in flight failed UNAVAILABLE within {:.2} s: {}",
        results.len(),
        failed_after.as_secs_f64(),
        results[0].as_ref().unwrap_err().message()
    );
    // Link back after 2 s.
    let wait = Duration::from_secs(2).saturating_sub(down.elapsed());
    tokio::time::sleep(wait).await;
    link(true);
    let up = Instant::now();
    blocking(Duration::from_secs(30), "GID back", wait_gid).await;
    // The channel reconnects on a later call (the first ones may still fail while ARP and
    // the GID settle).
    let mut attempts = 0;
    loop {
        attempts += 1;
        match echo(&ch, 100 + attempts, 100_000, false).await {
            Ok(()) => break,
            Err(e) => {
                assert!(
                    up.elapsed() < Duration::from_secs(30),
                    "no call succeeded within 30 s of the link coming back: {e}"
                );
                eprintln!("after the flap, attempt {attempts}: {e}");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    println!(
        "LINK | 2 s flap | reconnected {:.2} s after the link came back ({attempts} attempts)",
        up.elapsed().as_secs_f64()
    );
    for k in 0..20 {
        echo(&ch, 200 + k, 1000, false)
            .await
            .expect("calls after reconnecting");
    }
    assert!(ch.is_connected());
}

/// Keepalive of the quiet connection of `link_down_for_good`: first probe after 2 s of
/// silence, dead after 3 s more without an answer (probes every second): a bound of 5 s.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(3);
const KEEPALIVE_BOUND: Duration = Duration::from_secs(5);
/// The default keepalive's bound (10 s, then 20 s of probes every 7 s: 31 s).
const DEFAULT_KEEPALIVE_BOUND: Duration = Duration::from_secs(31);
/// Room for the emulated VM on top of a keepalive bound.
const KEEPALIVE_SLACK: Duration = Duration::from_secs(10);

/// A quiet connection: its only call is a `Sleep` of two minutes without a deadline, its
/// request delivered, nothing else on the connection. When the link dies no post of its
/// fails; keepalive on the bootstrap connection must notice. Returns the call's result and
/// when it ended.
async fn quiet_call(ch: Channel, seq: u64) -> (Result<(), Status>, Instant) {
    let req = Request::new(SleepRequest {
        seq,
        ms: 120_000,
        reply_len: 0,
        pad: pattern(10, seq),
    });
    let r: Result<Response<Blob>, Status> = ch.unary(&lab_server::SLEEP, req).await;
    (r.map(|_| ()), Instant::now())
}

/// That a quiet call ended `UNAVAILABLE` by keepalive within `bound` (plus the slack) of the
/// link going down; prints the figure.
#[track_caller]
fn assert_keepalive_ended(
    (r, ended): &(Result<(), Status>, Instant),
    down: Instant,
    bound: Duration,
    what: &str,
) {
    let st = r
        .as_ref()
        .expect_err("a quiet call while the link went down");
    let took = ended.saturating_duration_since(down);
    assert_eq!(st.code(), Code::Unavailable, "{what}: {st}");
    let named = format!(
        "keepalive: the server did not answer for {} s",
        bound.as_secs()
    );
    assert!(
        st.message().contains(&named),
        "{what}: the status does not say '{named}': {st}"
    );
    assert!(
        took <= bound + KEEPALIVE_SLACK,
        "{what}: ended {took:?} after the link went down (bound {bound:?})"
    );
    println!(
        "LINK | down for good | {what} (keepalive bound {} s): call without deadline failed \
         UNAVAILABLE {:.2} s after the link went down: {}",
        bound.as_secs(),
        took.as_secs_f64(),
        st.message()
    );
}

/// The link goes down for good: the calls in flight fail the same way, and every later call
/// fails UNAVAILABLE within the limit (no hang), while the link stays down. Two quiet
/// connections, each with one call without a deadline in flight and no other traffic, end
/// `UNAVAILABLE` naming keepalive within its bound: one with a short keepalive (5 s), one with
/// the default (31 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes the host's network: run between two VMs by softroce/ci.sh"]
async fn link_down_for_good() {
    let Some(addr) = remote_or_skip() else { return };
    remote::wait_listening(&addr).await;
    let _restore = Restore;
    let ch =
        remote::connect(Channel::builder(addr.clone()).connect_timeout(Duration::from_secs(5)))
            .await;
    echo(&ch, 1, 100, false).await.expect("a call before");
    let quiet_short = remote::connect(
        Channel::builder(addr.clone())
            .keep_alive_interval(KEEPALIVE_INTERVAL)
            .keep_alive_timeout(KEEPALIVE_TIMEOUT),
    )
    .await;
    let quiet_default = remote::connect(Channel::builder(addr.clone())).await;
    echo(&quiet_short, 2, 100, false)
        .await
        .expect("a call before");
    echo(&quiet_default, 3, 100, false)
        .await
        .expect("a call before");
    let quiet_short = tokio::spawn(quiet_call(quiet_short, 4));
    let quiet_default = tokio::spawn(quiet_call(quiet_default, 5));
    // Their requests reach the server (and calls_across_link_down waits 500 ms more).
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !quiet_short.is_finished() && !quiet_default.is_finished(),
        "a quiet call ended before the link went down"
    );
    let (results, down) = calls_across_link_down(&ch, 4, FAIL_LIMIT).await;
    for (i, r) in results.iter().enumerate() {
        let st = r
            .as_ref()
            .expect_err("a call in flight while the link went down");
        assert_names_cause(st, &format!("call {i} in flight"));
    }
    println!(
        "LINK | down for good | {} calls in flight failed UNAVAILABLE within {:.2} s: {}",
        results.len(),
        down.elapsed().as_secs_f64(),
        results[0].as_ref().unwrap_err().message()
    );
    for k in 0..3 {
        let t = Instant::now();
        let r = within(Duration::from_secs(20), "a call while down", async {
            echo(&ch, 10 + k, 100, false).await
        })
        .await;
        let st = r.expect_err("a call while the link is down");
        assert_eq!(st.code(), Code::Unavailable, "call while down: {st}");
        assert!(
            t.elapsed() < Duration::from_secs(15),
            "a call while down took {:?}",
            t.elapsed()
        );
        println!(
            "LINK | down for good | call {k} while down: UNAVAILABLE after {:.2} s: {}",
            t.elapsed().as_secs_f64(),
            st.message()
        );
    }
    let short = within(
        KEEPALIVE_BOUND + KEEPALIVE_SLACK,
        "the quiet call (short keepalive)",
        quiet_short,
    )
    .await
    .unwrap();
    assert_keepalive_ended(&short, down, KEEPALIVE_BOUND, "quiet connection");
    let default = within(
        (DEFAULT_KEEPALIVE_BOUND + KEEPALIVE_SLACK).saturating_sub(down.elapsed()),
        "the quiet call (default keepalive)",
        quiet_default,
    )
    .await
    .unwrap();
    assert_keepalive_ended(
        &default,
        down,
        DEFAULT_KEEPALIVE_BOUND,
        "quiet connection, default keepalive",
    );
}

/// The active MTU of this host's first rxe port, as a new context sees it.
#[cfg(feature = "ibverbs")]
fn active_mtu() -> u32 {
    use rpc_core::verbs::{Context, Provider};
    rpc_core::verbs::ib::Ib::open(None)
        .expect("open the RDMA device")
        .info()
        .active_mtu
}

#[cfg(feature = "ibverbs")]
fn wait_active_mtu(want: u32) {
    let start = Instant::now();
    loop {
        let got = active_mtu();
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "active MTU {got}, want {want}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// MTU mismatch: this host's NIC at MTU 1500 (rxe active MTU 1024) against the server's 9000
/// (active MTU 4096). The handshake carries each end's active MTU and both QPs take the
/// smaller one (path MTU 1024), so every size gets through; the NIC's MTU then goes back.
#[cfg(feature = "ibverbs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "changes the host's network: run between two VMs by softroce/ci.sh"]
async fn mtu_mismatch_negotiates_down() {
    let Some(addr) = remote_or_skip() else { return };
    remote::wait_listening(&addr).await;
    struct MtuBack;
    impl Drop for MtuBack {
        fn drop(&mut self) {
            let _ = Command::new("/bin/ip")
                .args(["link", "set", &netdev(), "mtu", "9000"])
                .output();
        }
    }
    let _back = MtuBack;
    blocking(Duration::from_secs(30), "active MTU 4096", || {
        wait_active_mtu(4096)
    })
    .await;
    sh("ip", &["link", "set", &netdev(), "mtu", "1500"]);
    blocking(Duration::from_secs(30), "active MTU 1024", || {
        wait_active_mtu(1024)
    })
    .await;
    let ch = remote::connect(Channel::builder(addr.clone())).await;
    for (k, n) in [100usize, 5000, 64 << 10, 1 << 20, 4 << 20]
        .into_iter()
        .enumerate()
    {
        echo(&ch, 300 + k as u64, n, k % 2 == 0)
            .await
            .unwrap_or_else(|e| panic!("echo of {n} B across MTU 1024 / 4096: {e}"));
    }
    println!(
        "MTU | client NIC 1500 (active 1024), server 9000 (active 4096): 5 echoes up to 4 MiB passed"
    );
    drop(ch);
    sh("ip", &["link", "set", &netdev(), "mtu", "9000"]);
    blocking(Duration::from_secs(30), "active MTU 4096 again", || {
        wait_active_mtu(4096)
    })
    .await;
}
