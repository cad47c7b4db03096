//! A server shard's connections share its receive pool (one SRQ) and its send slots: credits
//! are granted from the pool and taken back, so receive memory follows the calls in flight,
//! not the connections (issue 14). Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use common::proc::{ChildProc, child_role, exit_with_parent, report};
use common::*;
use rpc_core::{Channel, ClientPoller, Code, Request, Response};

const ENTRY: &str = "child_process_entry";
const ADDR_ENV: &str = "RPC_TEST_SERVER_ADDR";

/// Connections the killed client process opens (fewer in the emulated VM).
fn kill_conns() -> usize {
    if in_vm() { 60 } else { 1000 }
}

/// Not a test: the body of the child process of the kill test (run with `--ignored
/// --exact`): opens many caller-polled connections to the parent's server, leaves a call in
/// flight on every tenth (a handler that sleeps), keeps one busy, and waits to be killed.
#[test]
#[ignore = "entry point of the child processes of this binary's tests"]
fn child_process_entry() {
    let Some(role) = child_role() else {
        eprintln!("child_process_entry only runs as a child process of this binary's tests");
        return;
    };
    exit_with_parent(Duration::from_secs(300));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    if role == "serve" {
        rt.block_on(async {
            let srv =
                TestServer::start_with(|b| b.shards(1).poll_mode(rpc_core::ShardPolling::Busy))
                    .await;
            report("addr", srv.addr());
            std::future::pending::<()>().await;
        });
        return;
    }
    assert_eq!(role, "many", "unknown child role");
    rt.block_on(async {
        let addr = std::env::var(ADDR_ENV).expect("server address");
        let mut chans = Vec::new();
        for i in 0..kill_conns() {
            let ch = Channel::builder(&addr)
                .poller(ClientPoller::Caller)
                .connect()
                .await
                .expect("child connects");
            echo_seq(&ch, i as u64).await;
            if i % 10 == 0 {
                let c = ch.clone();
                tokio::spawn(async move {
                    let req = Request::new(SleepRequest {
                        seq: i as u64,
                        ms: 120_000,
                        ..SleepRequest::default()
                    });
                    let _ = c.unary::<_, Blob>(&lab_server::SLEEP, req).await;
                });
            }
            chans.push(ch);
        }
        let busy = chans[1].clone();
        tokio::spawn(async move {
            for seq in 0u64.. {
                let _ = echo_call(&busy, seq).await;
            }
        });
        report("open", chans.len());
        std::future::pending::<()>().await;
    });
}

/// Slots an idle connection holds (the server's floor).
const FLOOR: u64 = 4;

fn windows(srv: &TestServer) -> u64 {
    let p = srv.server.receive_pool();
    p.slots - p.free - p.lent
}

/// Idle connections hold the floor of the pool each; a pipelined burst grows one connection's
/// window, and once that connection is idle the server takes the slots back (the client
/// answers a reclaim), down to the floor again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_grow_with_calls_in_flight_and_come_back_when_idle() {
    const IDLE: u64 = 40;
    let srv = TestServer::start_with(|b| b.shards(1)).await;
    let mut idle = Vec::new();
    for i in 0..IDLE {
        let ch = srv.channel(ClientPoller::Caller).await;
        echo_seq(&ch, i).await;
        idle.push(ch);
    }
    let busy = srv.channel(ClientPoller::Thread).await;
    echo_seq(&busy, 1000).await;
    let floor = (IDLE + 1) * FLOOR;
    wait_until(Duration::from_secs(10), "windows at the floor", || {
        windows(&srv) == floor
    })
    .await;
    let ch = busy.clone();
    blocking(Duration::from_secs(120), "pipeline", move || {
        pipeline_run(&ch, 2000, 32)
    })
    .await;
    let grown = windows(&srv);
    assert!(
        grown > floor,
        "32 calls in flight grew the busy connection's window ({grown} <= {floor})"
    );
    // Idle for longer than the reclaim delay: its client gives the slots back.
    wait_until(Duration::from_secs(10), "the busy window reclaimed", || {
        windows(&srv) == floor
    })
    .await;
    let p = srv.server.receive_pool();
    assert_eq!(p.lent, 0);
    assert!(
        p.slots <= 2 * 512,
        "41 connections and one burst need at most two chunks of the pool: {p:?}"
    );
    // Everyone still works, and the reclaimed connection grows again.
    for (i, ch) in idle.iter().enumerate() {
        echo_seq(ch, 2000 + i as u64).await;
    }
    let ch = busy.clone();
    blocking(Duration::from_secs(120), "pipeline again", move || {
        pipeline_run(&ch, 500, 32)
    })
    .await;
}

/// A pool at its limit refuses a connection with RESOURCE_EXHAUSTED naming the pool, serves
/// the connections it holds, and admits again once one closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_pool_refuses_connections_clearly_and_recovers() {
    // Room for two connections' floors.
    let srv = TestServer::start_with(|b| b.shards(1).receive_pool_slots(2 * FLOOR as u32)).await;
    let a = srv.channel(ClientPoller::Caller).await;
    let b = srv.channel(ClientPoller::Caller).await;
    echo_seq(&a, 1).await;
    echo_seq(&b, 2).await;
    let refused = within(
        Duration::from_secs(20),
        "connect",
        srv.builder().poller(ClientPoller::Caller).connect(),
    )
    .await
    .expect_err("a third connection finds no room in the pool");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused}");
    assert!(
        refused.to_string().contains("receive pool"),
        "the refusal names the pool: {refused}"
    );
    // The two connections go on, with their two data credits each, 32 calls at a time.
    let mut calls = Vec::new();
    for i in 0..32u64 {
        let ch = if i % 2 == 0 { a.clone() } else { b.clone() };
        calls.push(tokio::spawn(async move { echo_seq(&ch, 100 + i).await }));
    }
    for c in calls {
        within(Duration::from_secs(60), "calls", c).await.unwrap();
    }
    drop(a);
    wait_until(
        Duration::from_secs(10),
        "the first connection closed",
        || srv.server.connections() == 1,
    )
    .await;
    let c = within(Duration::from_secs(20), "connect", async {
        loop {
            match srv.builder().poller(ClientPoller::Caller).connect().await {
                Ok(c) => break c,
                Err(e) if e.code() == Code::ResourceExhausted => {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(e) => panic!("reconnect: {e}"),
            }
        }
    })
    .await;
    echo_seq(&c, 3).await;
    echo_seq(&b, 4).await;
}

/// A shard with a handful of send slots for many connections and calls: responses that find
/// no free slot wait (encoded aside) and go out as slots come back, none lost, none mixed up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_with_few_send_slots_answers_every_call() {
    let g = rpc_core::Geometry {
        send_slots: 8,
        ..rpc_core::Geometry::default()
    };
    let srv = TestServer::start_with(move |b| b.shards(1).geometry(g)).await;
    let mut chans = Vec::new();
    for _ in 0..6 {
        chans.push(srv.channel(ClientPoller::Thread).await);
    }
    let mut calls = Vec::new();
    for (c, ch) in chans.iter().enumerate() {
        for i in 0..24u64 {
            let ch = ch.clone();
            let seq = c as u64 * 1000 + i;
            calls.push(tokio::spawn(async move {
                // Responses of 2 KiB: eager, but too long to be sent inline, so each holds
                // its send slot until its SEND completes.
                let n = 2048 + (seq % 7) as usize;
                let mut req = Request::new(Blob {
                    seq,
                    data: pattern(n, seq),
                });
                req.set_timeout(Duration::from_secs(60));
                let r: Response<Blob> = ch
                    .unary(&lab_server::ECHO, req)
                    .await
                    .unwrap_or_else(|e| panic!("call {seq}: {e:?}"));
                check_blob(r.get_ref(), seq, n, "echo");
            }));
        }
    }
    for c in calls {
        within(Duration::from_secs(120), "calls", c).await.unwrap();
    }
    srv.settle("every call answered").await;
}

/// A client process holding a thousand connections (calls in flight on a hundred, one
/// connection busy) is killed: the server loses no other connection's call, frees every one
/// of the dead client's connections, handlers and pool slots, and serves new clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_client_with_a_thousand_connections_gives_everything_back() {
    init_logs();
    let srv = TestServer::start_with(|b| b.shards(1)).await;
    let mine = srv.channel(ClientPoller::Thread).await;
    echo_seq(&mine, 0).await;
    let mut child = ChildProc::spawn(ENTRY, "many", &[(ADDR_ENV, srv.addr())]);
    let open = child.expect("open", Duration::from_secs(240));
    assert_eq!(open, kill_conns().to_string());
    assert_eq!(srv.server.connections(), kill_conns() + 1);
    wait_until(
        Duration::from_secs(30),
        "the child's sleeping calls",
        || srv.state.sleeping() >= (kill_conns() / 10) as u64,
    )
    .await;
    // Our calls go on beside the dead client's, before and after the kill.
    for seq in 1..50 {
        echo_seq(&mine, seq).await;
    }
    child.kill();
    for seq in 50..100 {
        echo_seq(&mine, seq).await;
    }
    wait_until(
        Duration::from_secs(60),
        "the dead client's connections closed",
        || srv.server.connections() == 1,
    )
    .await;
    srv.settle("the dead client's handlers dropped").await;
    // Every slot is back: our connection holds its window, nothing else.
    wait_until(Duration::from_secs(10), "the pool's slots back", || {
        let p = srv.server.receive_pool();
        p.lent == 0 && p.slots - p.free <= 128
    })
    .await;
    let fresh = srv.channel(ClientPoller::Caller).await;
    echo_seq(&fresh, 1000).await;
    echo_seq(&mine, 1001).await;
}

/// A server in another process answers 64 pipelined calls of 4 KiB at a time: its responses
/// are too long to be sent inline, so each holds a send slot of the shard until its SEND
/// completes, and the connection's share of the shard's slots keeps its QP's send queue from
/// overflowing (it once overflowed and failed the connection: the shard's shared slots no
/// longer bounded one connection's SENDs in flight).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_process_answers_64_pipelined_4k_calls() {
    let mut child = ChildProc::spawn(ENTRY, "serve", &[]);
    let addr = child.expect("addr", Duration::from_secs(60));
    let ch = within(
        Duration::from_secs(20),
        "connect",
        Channel::builder(&addr)
            .poller(ClientPoller::Caller)
            .max_concurrent_calls(128)
            .connect(),
    )
    .await
    .unwrap();
    blocking(Duration::from_secs(120), "pipeline", move || {
        let n = if in_vm() { 500 } else { 20_000 };
        let mut p = ch
            .pipeline::<Blob, Blob>(&lab_server::ECHO)
            .expect("pipeline");
        let (mut next, mut done) = (0u64, 0u64);
        while done < n {
            while next < n && p.in_flight() < 64 {
                let mut req = Request::new(Blob {
                    seq: next,
                    data: pattern(4096, next),
                });
                req.set_timeout(Duration::from_secs(30));
                p.submit(next, req).expect("submit");
                next += 1;
            }
            if let Some((tag, r)) = p.wait() {
                let r = r.unwrap_or_else(|e| panic!("pipelined call {tag}: {e:?}"));
                check_blob(r.get_ref(), tag, 4096, "pipelined 4 KiB echo");
                done += 1;
            }
        }
    })
    .await;
}
