//! Tests across two hosts (`softroce/vm.sh pair`: two VMs, one rxe device each, joined by a
//! virtual Ethernet cable). The server side of a suite runs in one host as the ignored entry
//! test `serve_for_the_pair` (with `RPC_TEST_SERVE=ip:port`), the client side in the other:
//! the tests of the suite that take a [`Target`] connect to the remote server when
//! `RPC_TEST_REMOTE=ip:port` is set, and start a local server (as before) when it is not.
//!
//! This file is included by `common` (the `lab.Lab` suites) and by the interop suites (which
//! have their own harness), so it depends on nothing but `rpc_core`.
//!
//! A suite serves several differently configured servers, one per [`Slot`], on consecutive
//! ports from the base port. Server-side counters live in the other process: a test asserts
//! them only against a local server ([`Target::local`]); the remote server checks at the end
//! that every call left it (no live call within 20 s after the client is done).

#![allow(dead_code)]

use std::future::Future;
use std::io::BufRead;
use std::time::{Duration, Instant};

use rpc_core::{Channel, ChannelBuilder, RunningServer, ServerBuilder};

/// `ip:port` of the remote server's base port (client side).
pub const REMOTE_ENV: &str = "RPC_TEST_REMOTE";
/// `ip:port` the entry `serve_for_the_pair` binds its base port to (server side).
pub const SERVE_ENV: &str = "RPC_TEST_SERVE";

/// How long a pair server serves at most (the client side is done long before).
pub const SERVE_LIMIT: Duration = Duration::from_secs(1500);

/// One server configuration of a suite: its port offset and its builder options.
#[derive(Clone, Copy)]
pub struct Slot {
    pub offset: u16,
    pub config: fn(ServerBuilder) -> ServerBuilder,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("offset", &self.offset)
            .finish()
    }
}

/// `host:port + offset` of an `ip:port` variable, if it is set.
pub fn addr_of(var: &str, offset: u16) -> Option<String> {
    let v = std::env::var(var).ok()?;
    let (host, port) = v
        .rsplit_once(':')
        .unwrap_or_else(|| panic!("{var}={v}: want ip:port"));
    let port: u16 = port
        .parse()
        .unwrap_or_else(|_| panic!("{var}={v}: bad port"));
    Some(format!("{host}:{}", port + offset))
}

/// The remote server of `slot`, when `RPC_TEST_REMOTE` is set.
pub fn remote_addr(slot: &Slot) -> Option<String> {
    addr_of(REMOTE_ENV, slot.offset)
}

/// Whether the client side runs against a remote server.
pub fn is_remote() -> bool {
    std::env::var_os(REMOTE_ENV).is_some()
}

/// Waits (up to 60 s) until something accepts TCP connections on `addr`: a pair server in the
/// other VM starts at the same time as the client side. Probes each address once per process
/// (the server logs each probe as a refused handshake).
pub async fn wait_listening(addr: &str) {
    static SEEN: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    if SEEN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|a| a == addr)
    {
        return;
    }
    wait_listening_once(addr).await;
    SEEN.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(addr.to_owned());
}

async fn wait_listening_once(addr: &str) {
    let start = Instant::now();
    loop {
        match tokio::net::TcpStream::connect(addr).await {
            Ok(_) => return,
            Err(e) => {
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "nothing listens on {addr} after 60 s: {e}"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
}

/// Connects `b`, retrying for up to 60 s while the server refuses the TCP connection (a pair
/// server in the other VM starts at the same time as the client).
pub async fn connect(b: ChannelBuilder) -> Channel {
    let start = std::time::Instant::now();
    loop {
        match within(Duration::from_secs(30), "connect", b.clone().connect()).await {
            Ok(ch) => return ch,
            Err(e) if start.elapsed() < Duration::from_secs(60) && is_remote() => {
                eprintln!("connect: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(e) => panic!("channel connects: {e}"),
        }
    }
}

/// The server side of a pair run: binds one server per slot (from `RPC_TEST_SERVE`'s base
/// port) with `bind`, serves until stdin closes (`vm.sh pair` closes it once the client VM is
/// done) or [`SERVE_LIMIT`], then checks that no call is left on any server and shuts them
/// down. Without `RPC_TEST_SERVE` it says so and returns (the entry is an ignored test).
pub async fn serve<F, Fut>(slots: &[Slot], bind: F)
where
    F: Fn(String, Slot) -> Fut,
    Fut: Future<Output = RunningServer>,
{
    let Some(_) = addr_of(SERVE_ENV, 0) else {
        eprintln!("serve_for_the_pair: {SERVE_ENV} is not set; nothing to serve");
        return;
    };
    let mut servers = Vec::new();
    for slot in slots {
        let addr = addr_of(SERVE_ENV, slot.offset).expect("serve address");
        let s = bind(addr.clone(), *slot).await;
        eprintln!("serve_for_the_pair: serving on {}", s.local_addr());
        servers.push(s);
    }
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let stdin = std::io::stdin();
        let mut line = String::new();
        while matches!(stdin.lock().read_line(&mut line), Ok(n) if n > 0) {
            line.clear();
        }
        let _ = tx.send(());
    });
    let ended = tokio::time::timeout(SERVE_LIMIT, rx).await.is_ok();
    assert!(
        ended,
        "the client side did not finish within {SERVE_LIMIT:?}"
    );
    for s in &servers {
        let t0 = Instant::now();
        while s.live_calls() != 0 {
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "server {}: {} calls still live 20 s after the client side ended",
                s.local_addr(),
                s.live_calls()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    for s in servers {
        within(Duration::from_secs(20), "shutdown", s.shutdown()).await;
    }
    eprintln!("serve_for_the_pair: done");
}

async fn within<F: Future>(limit: Duration, what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(limit, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what}: no result within {limit:?} (hang)"),
    }
}
