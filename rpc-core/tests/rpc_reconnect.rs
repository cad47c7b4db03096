//! Clients that connect, call and disconnect again and again leave the server as it was:
//! - one client process against a server in a child process limited to 1024 descriptors:
//!   1200 connections in a row (more than it may hold descriptors), the same descriptors and
//!   receive pool at the end as after 10;
//! - three client processes at once beside a client that keeps calling: every call and
//!   reconnection served, the same descriptors after, the receive pool at most one chunk
//!   larger;
//! - a caller-polled channel's descriptors all close with it.
//!
//! (The soft provider once kept a pidfd per connection of a live client process, then a
//! duplicate of each closed channel's eventfd; the shard's receive pool once grew a 4 MiB
//! chunk every 128 reconnections.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::proc::{self, ChildProc, child_role, report};
use common::{TestServer, echo_seq, open_fds, within};
use rpc_core::{Channel, ClientPoller};

const ENTRY: &str = "child_process_entry";
const CONNECTIONS: u64 = 1200;
const FD_LIMIT: u64 = 1024;

/// The tests of this binary count descriptors of their processes: one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Not a test: the body of the child processes (run with `--ignored --exact`), by role.
#[test]
#[ignore = "entry point of the child processes of this binary's tests"]
fn child_process_entry() {
    match child_role().as_deref() {
        Some("server") => child_server(),
        Some("churn") => child_churn(),
        _ => eprintln!("child_process_entry only runs as a child process of this binary's tests"),
    }
}

/// Connects to `addr`, makes call `seq` and disconnects; panics when refused.
async fn connect_call_close(addr: &str, seq: u64) {
    let ch = within(
        Duration::from_secs(20),
        "connect",
        Channel::builder(addr).connect(),
    )
    .await
    .unwrap_or_else(|e| panic!("connection {seq} refused: {e}"));
    echo_seq(&ch, seq).await;
}

/// A client that connects to `CHURN_ADDR`, makes one call and disconnects,
/// `CHURN_CONNECTIONS` times in a row as fast as it can, then reports `done`.
fn child_churn() {
    proc::exit_with_parent(Duration::from_secs(300));
    let addr = std::env::var("CHURN_ADDR").unwrap();
    let n: u64 = std::env::var("CHURN_CONNECTIONS").unwrap().parse().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for seq in 0..n {
            connect_call_close(&addr, seq).await;
        }
        report("done", n);
    });
}

/// The server child: lowers its descriptor limit, serves `lab.Lab`, reports its address,
/// then its open descriptors whenever asked (a line on stdin).
fn child_server() {
    let lim = libc::rlimit {
        rlim_cur: FD_LIMIT,
        rlim_max: FD_LIMIT,
    };
    // SAFETY: a valid rlimit for this process.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);
    // Not `exit_with_parent`: stdin carries the parent's requests here; its end ends us.
    std::thread::spawn(|| {
        std::thread::sleep(Duration::from_secs(600));
        std::process::exit(0);
    });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let srv = TestServer::start().await;
        report("addr", srv.addr());
        let stdin = tokio::io::stdin();
        use tokio::io::AsyncBufReadExt;
        let mut lines = tokio::io::BufReader::new(stdin).lines();
        while let Ok(Some(_)) = lines.next_line().await {
            // Let closed connections finish closing before counting (one stays open).
            common::wait_until(Duration::from_secs(20), "connections closed", || {
                srv.server.connections() == 1
            })
            .await;
            report("fds", open_fds());
            report("fd_kinds", fd_kinds());
            report("pool", srv.server.receive_pool().slots);
        }
        std::process::exit(0);
    });
}

/// This process's open descriptors by what they are (`socket`, `anon_inode:[eventfd]`,
/// `/memfd:soft-rnic-mr (deleted)`, ...), with counts: what a failure message shows.
fn fd_kinds() -> String {
    let mut kinds = std::collections::BTreeMap::<String, usize>::new();
    for e in std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(e.path()).map_or_else(
            |_| "?".into(),
            |p| {
                let t = p.display().to_string();
                // `socket:[12345]`, `pipe:[678]`: the inode number says nothing here.
                match t.split_once(":[") {
                    Some((kind, n))
                        if n.trim_end_matches(']').bytes().all(|b| b.is_ascii_digit()) =>
                    {
                        kind.to_owned()
                    }
                    _ => t,
                }
            },
        );
        *kinds.entry(target).or_default() += 1;
    }
    let kinds: Vec<String> = kinds.iter().map(|(k, n)| format!("{n} {k}")).collect();
    kinds.join(", ")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reconnects_leaks_no_server_descriptor() {
    let _serial = SERIAL.lock().await;
    use rpc_core::verbs::ProviderKind;
    if ProviderKind::from_env().ok() != Some(ProviderKind::Soft) {
        // The descriptors at stake are the soft RNIC's (a pidfd per peer process); on ib,
        // 2000 connections in the TCG VM would take many minutes.
        eprintln!("soft provider only");
        return;
    }
    common::init_logs();
    let mut child = ChildProc::spawn(ENTRY, "server", &[]);
    let addr = child.expect("addr", Duration::from_secs(60));
    let mut before = None;
    // One channel stays open throughout, so the server keeps its state for this client
    // process; and the client opens more descriptors beside its channels as it goes, so each
    // channel's eventfd gets a new number. (The server once kept a duplicate of each closed
    // channel's eventfd, up to 64, while the process had another connection.)
    let keep = Channel::builder(&addr).connect().await.unwrap();
    let mut spacers = Vec::new();
    for seq in 0..CONNECTIONS {
        if spacers.len() == 100 {
            spacers.clear();
        }
        spacers.push(std::fs::File::open("/dev/null").unwrap());
        connect_call_close(&addr, seq).await;
        if seq == 9 {
            child.tell("count");
            before = Some((
                child.expect("fds", Duration::from_secs(30)),
                child.expect("fd_kinds", Duration::from_secs(30)),
                child.expect("pool", Duration::from_secs(30)),
            ));
        }
    }
    child.tell("count");
    let after: usize = child
        .expect("fds", Duration::from_secs(30))
        .parse()
        .unwrap();
    let kinds_after = child.expect("fd_kinds", Duration::from_secs(30));
    let pool_after = child.expect("pool", Duration::from_secs(30));
    let (before, kinds_before, pool_before) = before.unwrap();
    let before: usize = before.parse().unwrap();
    assert!(
        after <= before + 8,
        "the server holds {after} descriptors after {CONNECTIONS} connections ({kinds_after}), \
         {before} after 10 ({kinds_before})"
    );
    // One connection at a time never needs more than the pool's first chunk (the windows of
    // closed connections once waited for a pause in the closes, and the pool grew meanwhile).
    assert_eq!(
        pool_after, pool_before,
        "the server's receive pool grew from {pool_before} to {pool_after} slots"
    );
    echo_seq(&keep, CONNECTIONS).await;
    child.kill();
}

/// A caller-polled channel costs its process a few descriptors (with the server in the same
/// process, both ends' count here), and they all close when the channel is dropped, though
/// its driver task may end after it. (Its runtime registration once held a duplicate of the
/// completion channel's descriptor: one more per connection.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn caller_polled_channels_cost_few_descriptors_and_give_them_back() {
    const CHANNELS: usize = 32;
    let _serial = SERIAL.lock().await;
    common::init_logs();
    let srv = TestServer::start().await;
    let first = srv.channel(ClientPoller::Caller).await;
    echo_seq(&first, 0).await;
    let before = open_fds();
    let mut chans = Vec::new();
    for i in 0..CHANNELS {
        let ch = srv.channel(ClientPoller::Caller).await;
        // An async call: the channel's driver task is running.
        echo_seq(&ch, i as u64 + 1).await;
        chans.push(ch);
    }
    let during = open_fds();
    let per = (during.saturating_sub(before)) as f64 / CHANNELS as f64;
    eprintln!("{per:.2} descriptors per connection (client and server ends)");
    // Soft: the client's TCP socket, channel eventfd and slot arena memfd; the server's TCP
    // socket and duplicate of the client's eventfd. ib: fewer (no memfd, no duplicate).
    assert!(
        per <= 5.0,
        "{CHANNELS} caller-polled channels opened {} descriptors ({per:.2} per connection)",
        during.saturating_sub(before)
    );
    drop(chans);
    common::wait_until(Duration::from_secs(20), "descriptors closed", || {
        open_fds() <= before + 2
    })
    .await;
    echo_seq(&first, 1000).await;
}

/// Several client processes reconnecting at once, beside a client that keeps calling: the
/// steady client's calls all succeed, every reconnection is served, and afterwards the
/// server holds as many descriptors as before and at most one chunk more of receive pool
/// (the windows of connections that closed are free again within milliseconds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_processes_that_reconnect_at_once_leave_the_server_as_it_was() {
    use rpc_core::verbs::ProviderKind;
    const PROCS: usize = 3;
    const EACH: u64 = 300;
    if ProviderKind::from_env().ok() != Some(ProviderKind::Soft) {
        // 900 connections in the TCG VM would take minutes.
        eprintln!("soft provider only");
        return;
    }
    let _serial = SERIAL.lock().await;
    common::init_logs();
    let srv = TestServer::start().await;
    let steady = srv.channel(ClientPoller::Caller).await;
    echo_seq(&steady, 0).await;
    let before = open_fds();
    let pool_before = srv.server.receive_pool().slots;
    let mut churners: Vec<ChildProc> = (0..PROCS)
        .map(|_| {
            ChildProc::spawn(
                ENTRY,
                "churn",
                &[
                    ("CHURN_ADDR", srv.addr().to_string()),
                    ("CHURN_CONNECTIONS", EACH.to_string()),
                ],
            )
        })
        .collect();
    // The steady client calls until every churner is done.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let waiter = {
        let done = std::sync::Arc::clone(&done);
        tokio::task::spawn_blocking(move || {
            for c in &mut churners {
                let n = c.expect("done", Duration::from_secs(240));
                assert_eq!(n, EACH.to_string());
                done.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            }
            churners
        })
    };
    let mut seq = 1;
    while done.load(std::sync::atomic::Ordering::Acquire) < PROCS {
        within(
            Duration::from_secs(5),
            "a steady call",
            echo_seq(&steady, seq),
        )
        .await;
        seq += 1;
    }
    drop(waiter.await.unwrap());
    common::wait_until(Duration::from_secs(20), "connections closed", || {
        srv.server.connections() == 1
    })
    .await;
    let after = open_fds();
    assert!(
        after <= before + 8,
        "the server process holds {after} descriptors after {} reconnections ({}), {before} \
         before",
        PROCS as u64 * EACH,
        fd_kinds()
    );
    let pool_after = srv.server.receive_pool().slots;
    assert!(
        pool_after <= pool_before * 2,
        "the receive pool grew from {pool_before} to {pool_after} slots"
    );
    eprintln!("{seq} steady calls; receive pool {pool_before} -> {pool_after} slots");
    echo_seq(&steady, seq).await;
}
