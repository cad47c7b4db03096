//! A client process that connects, calls and disconnects again and again costs the server no
//! descriptor per connection: a server in a child process limited to 1024 open descriptors
//! serves 1200 connections in a row (more than it may hold descriptors), and holds about as
//! many descriptors at the end as at the start. (The soft provider once kept a pidfd per
//! connection of a live client process.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::proc::{ChildProc, child_role, report};
use common::{TestServer, echo_seq, open_fds, within};
use rpc_core::Channel;

const ENTRY: &str = "child_process_entry";
const CONNECTIONS: u64 = 1200;
const FD_LIMIT: u64 = 1024;

/// Not a test: the body of the child server (run with `--ignored --exact`): lowers its
/// descriptor limit, serves `lab.Lab`, reports its address, then its open descriptors
/// whenever asked (a line on stdin).
#[test]
#[ignore = "entry point of the child process of this binary's tests"]
fn child_process_entry() {
    if child_role().is_none() {
        eprintln!("child_process_entry only runs as a child process of this binary's tests");
        return;
    }
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
            // Let closed connections finish closing before counting.
            common::wait_until(Duration::from_secs(20), "connections closed", || {
                srv.server.connections() == 0
            })
            .await;
            report("fds", open_fds());
        }
        std::process::exit(0);
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reconnects_leaks_no_server_descriptor() {
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
    for seq in 0..CONNECTIONS {
        let ch = within(
            Duration::from_secs(20),
            "connect",
            Channel::builder(&addr).connect(),
        )
        .await
        .unwrap_or_else(|e| panic!("connection {seq} refused: {e}"));
        echo_seq(&ch, seq).await;
        drop(ch);
        if seq == 9 {
            child.tell("count");
            before = Some(child.expect("fds", Duration::from_secs(30)));
        }
    }
    child.tell("count");
    let after: usize = child
        .expect("fds", Duration::from_secs(30))
        .parse()
        .unwrap();
    let before: usize = before.unwrap().parse().unwrap();
    assert!(
        after <= before + 8,
        "the server holds {after} descriptors after {CONNECTIONS} connections, {before} after 10"
    );
    child.kill();
}
