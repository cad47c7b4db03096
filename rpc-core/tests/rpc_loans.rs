//! Bounded receive loans: a store whose handler keeps every request's `bytes` field and whose
//! client keeps every response's, forever. Fields of 512 B or more borrow their receive slot
//! while the connection's lending budget allows and are copied past it, so keeping everything
//! never stalls the ring: every call succeeds and every kept byte stays what was sent (a slot
//! reposted while a field still borrowed it would be overwritten by a later frame).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use common::proc::{ChildProc, child_role, exit_with_parent, report};
use common::*;
use rpc_core::{Channel, ClientPoller, Request, Response, Server, Status};

pub use keep_server::KeepServer;

const ENTRY: &str = "child_process_entry";

/// Calls of each test (fewer in the Soft-RoCE VM, which runs under software emulation).
fn calls() -> u64 {
    if in_vm() { 1_000 } else { 10_000 }
}

/// The store: keeps what it is given.
#[rpc_derive::service(package = "keep")]
pub trait Keep {
    /// Keeps the request's data and answers as many pattern bytes of the next seed.
    async fn put(&self, request: Blob) -> Result<Blob, Status>;
}

/// Keeps every request's `data` (as a key-value store keeps its values).
#[derive(Debug, Default)]
struct Store {
    kept: Mutex<Vec<(u64, Bytes)>>,
}

impl keep_server::Keep for std::sync::Arc<Store> {
    async fn put(&self, request: Request<Blob>) -> Result<Response<Blob>, Status> {
        let b = request.into_inner();
        let len = b.data.len();
        self.kept.lock().unwrap().push((b.seq, b.data));
        Ok(Response::new(Blob {
            seq: b.seq + 1,
            data: pattern(len, b.seq + 1),
        }))
    }
}

/// The size of call `i`'s payload: 512 B to 8 KiB (the larger ones above the eager limit go by
/// rendezvous, into bulk buffers, which may be kept too).
fn size_of(i: u64) -> usize {
    512 + (i as usize * 997) % (8192 - 512 + 1)
}

/// Runs `CALLS` calls keeping every response's data, then checks every kept byte.
async fn keep_calling(ch: &Channel) -> usize {
    let client = keep_client::KeepClient::new(ch.clone());
    let n = calls();
    let mut kept: Vec<(u64, Bytes)> = Vec::with_capacity(n as usize);
    for i in 0..n {
        let seq = 2 * i;
        let len = size_of(i);
        let mut req = Request::new(Blob {
            seq,
            data: pattern(len, seq),
        });
        req.set_timeout(Duration::from_secs(10));
        let r = within(Duration::from_secs(20), "put", client.put(req))
            .await
            .unwrap_or_else(|s| panic!("call {i} of {n} ({len} B) failed: {s}"));
        let b = r.into_inner();
        assert_eq!(b.seq, seq + 1, "call {i}: response sequence number");
        assert_eq!(b.data.len(), len, "call {i}: response length");
        kept.push((b.seq, b.data));
    }
    for (seq, data) in &kept {
        if let Some(at) = first_mismatch(data, *seq) {
            panic!("kept response {seq}: byte {at} of {} changed", data.len());
        }
    }
    kept.len()
}

/// Checks every byte the store kept.
fn check_store(store: &Store) {
    let kept = store.kept.lock().unwrap();
    assert_eq!(kept.len(), calls() as usize, "the store kept every request");
    for (seq, data) in kept.iter() {
        if let Some(at) = first_mismatch(data, *seq) {
            panic!("kept request {seq}: byte {at} of {} changed", data.len());
        }
    }
}

async fn start_store() -> (rpc_core::RunningServer, std::sync::Arc<Store>) {
    init_logs();
    let store = std::sync::Arc::new(Store::default());
    let server = within(
        Duration::from_secs(20),
        "bind",
        Server::builder()
            .add_service(KeepServer::new(std::sync::Arc::clone(&store)))
            .bind(LOCALHOST),
    )
    .await
    .expect("server binds");
    (server, store)
}

/// VmRSS of this process in bytes.
fn rss() -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Both sides keep every field, one process, both poller modes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeping_everything_never_stalls_a_connection() {
    let (server, store) = start_store().await;
    for mode in [ClientPoller::Thread, ClientPoller::Caller] {
        let before = rss();
        let ch = within(
            Duration::from_secs(20),
            "connect",
            Channel::builder(server.local_addr().to_string())
                .poller(mode)
                .connect(),
        )
        .await
        .expect("connects");
        store.kept.lock().unwrap().clear();
        assert_eq!(keep_calling(&ch).await, calls() as usize);
        check_store(&store);
        // What both sides keep is about 2 x 43 MB of payload; a loan that held a whole slot
        // or bulk buffer per field would be several times that.
        let kept: usize = (0..calls()).map(size_of).sum::<usize>() * 2;
        let grown = rss().saturating_sub(before);
        assert!(
            grown < kept * 3 + (64 << 20),
            "{mode:?}: RSS grew {grown} bytes for {kept} bytes kept"
        );
    }
}

/// The server in a child process keeps every request; this process keeps every response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keeping_everything_across_processes() {
    init_logs();
    let mut child = ChildProc::spawn(ENTRY, "server", &[]);
    let addr = child.expect("addr", Duration::from_secs(60));
    let ch = within(
        Duration::from_secs(20),
        "connect",
        Channel::builder(&addr).connect(),
    )
    .await
    .expect("connects");
    assert_eq!(keep_calling(&ch).await, calls() as usize);
    let verdict = child.expect("checked", Duration::from_secs(60));
    assert_eq!(verdict, "ok", "the server's kept requests");
}

/// Not a test: the body of the child process of `keeping_everything_across_processes`.
#[test]
#[ignore = "entry point of the child processes of this binary's tests"]
fn child_process_entry() {
    let Some(role) = child_role() else {
        eprintln!("child_process_entry only runs as a child process of this binary's tests");
        return;
    };
    assert_eq!(role, "server");
    exit_with_parent(Duration::from_secs(300));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let (server, store) = start_store().await;
        report("addr", server.local_addr());
        // Checked once every call arrived (the parent's last response is sent after the
        // handler kept its request).
        while store.kept.lock().unwrap().len() < calls() as usize {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let r = std::panic::catch_unwind(|| check_store(&store));
        report("checked", if r.is_ok() { "ok" } else { "corrupt" });
        std::future::pending::<()>().await;
        drop(server);
    });
}
