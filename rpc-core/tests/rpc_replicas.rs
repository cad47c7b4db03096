//! Replicas killed and drained under load, with exactly-once accounting: a balanced channel over
//! three replica processes (this binary re-executed, `RPC_TEST_CHILD`), eight tasks calling a
//! method that is not idempotent; one replica is SIGKILLed and another drained while the calls
//! run. Every replica reports each request it executes (before it answers), so the test knows
//! what ran where: a call that succeeded ran exactly once, one that failed "not executed" never
//! ran, any other failure (only on the killed replica) ran at most once; no call ran twice, none
//! hung. Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::proc::{ChildProc, child_role, exit_with_parent_and, report};
use common::{Blob, init_logs, pattern, within};
use rpc_core::{Channel, Code, Request, Response, Server, Status};

const ENTRY: &str = "child_process_entry";
const TASKS: u64 = 8;

/// Runs each request once and says so.
#[rpc_derive::service(package = "replicas")]
pub trait Work {
    /// Not idempotent: a call that may have run is never retried.
    async fn run(&self, request: Blob) -> Result<Blob, Status>;
}

struct Worker;

impl work_server::Work for Worker {
    async fn run(&self, request: Request<Blob>) -> Result<Response<Blob>, Status> {
        let b = request.into_inner();
        tokio::time::sleep(Duration::from_micros(300)).await;
        // Reported before the response is sent: a call that succeeded is always reported.
        report("ran", b.seq);
        Ok(Response::new(b))
    }
}

/// Not a test: the body of the replica processes of the test below.
#[test]
#[ignore = "entry point of the child processes of this binary's tests"]
fn child_process_entry() {
    let Some(role) = child_role() else {
        eprintln!("child_process_entry only runs as a child process of this binary's tests");
        return;
    };
    assert_eq!(role, "replica");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    exit_with_parent_and(Duration::from_secs(120), move |line| {
        let _ = tx.send(line.to_owned());
    });
    rt.block_on(async move {
        let server = Server::builder()
            .add_service(work_server::WorkServer::new(Worker))
            .shutdown_grace(Duration::from_secs(10))
            .bind("127.0.0.1:0")
            .await
            .unwrap();
        report("addr", server.local_addr());
        let mut server = Some(server);
        while let Some(cmd) = rx.recv().await {
            match cmd.as_str() {
                "drain" => {
                    if let Some(s) = server.take() {
                        s.shutdown().await;
                    }
                    report("drained", "");
                }
                // Every `ran` before this line has been written.
                "sync" => report("synced", ""),
                _ => {}
            }
        }
    });
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Outcome {
    Ok,
    NotExecuted,
    MayHaveRun,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_killed_and_drained_under_load_lose_and_repeat_nothing() {
    init_logs();
    let mut replicas: Vec<ChildProc> = (0..3)
        .map(|_| ChildProc::spawn(ENTRY, "replica", &[]))
        .collect();
    let (ch, balancer) = Channel::balance_channel();
    for (i, r) in replicas.iter_mut().enumerate() {
        let addr = r.expect("addr", Duration::from_secs(60));
        balancer.insert(format!("r{i}"), Channel::builder(addr));
    }

    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (ch, stop) = (ch.clone(), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let seq = t << 40 | i;
                let mut req = Request::new(Blob {
                    seq,
                    data: pattern(32, seq),
                });
                req.set_timeout(Duration::from_secs(20));
                let started = Instant::now();
                let r = ch.unary::<_, Blob>(&work_server::RUN, req).await;
                assert!(
                    started.elapsed() < Duration::from_secs(25),
                    "call {seq:#x} took {:?}",
                    started.elapsed()
                );
                let outcome = match r {
                    Ok(b) => {
                        assert_eq!(b.get_ref().seq, seq, "the response of its own request");
                        Outcome::Ok
                    }
                    Err(st) if st.is_not_executed() => Outcome::NotExecuted,
                    Err(st) => {
                        assert_eq!(st.code(), Code::Unavailable, "{st:?}");
                        Outcome::MayHaveRun
                    }
                };
                outcomes.push((seq, outcome));
                i += 1;
            }
            outcomes
        }));
    }

    let mut ran: HashMap<u64, u32> = HashMap::new();
    let mut note = |k: &str, v: &str| {
        if k == "ran" {
            *ran.entry(v.parse::<u64>().unwrap()).or_default() += 1;
        }
    };
    tokio::time::sleep(Duration::from_millis(700)).await;
    // r0 dies with calls in flight.
    replicas[0].kill();
    tokio::time::sleep(Duration::from_millis(700)).await;
    // r1 drains: what it has finishes, what reaches it is refused unexecuted and moves on.
    replicas[1].tell("drain");
    let drained = within(Duration::from_secs(60), "drain", async {
        tokio::task::block_in_place(|| {
            replicas[1].collect_until("drained", Duration::from_secs(60), &mut note)
        })
    })
    .await;
    assert!(drained.is_some(), "r1 drained");
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    let mut outcomes = Vec::new();
    for t in tasks {
        outcomes.extend(
            within(Duration::from_secs(60), "a task ends", t)
                .await
                .unwrap(),
        );
    }
    // Every report of every replica: r0's until it died, r1's and r2's up to a sync.
    tokio::task::block_in_place(|| {
        assert!(
            replicas[0]
                .collect_until("never", Duration::from_secs(30), &mut note)
                .is_none()
        );
        for r in &mut replicas[1..] {
            r.tell("sync");
            r.collect_until("synced", Duration::from_secs(30), &mut note)
                .expect("a live replica syncs");
        }
    });

    let count = |o: Outcome| outcomes.iter().filter(|(_, x)| *x == o).count();
    let (ok, not_run, maybe) = (
        count(Outcome::Ok),
        count(Outcome::NotExecuted),
        count(Outcome::MayHaveRun),
    );
    println!(
        "{} calls: {ok} ok, {not_run} failed not executed, {maybe} failed maybe run; {} ran",
        outcomes.len(),
        ran.len()
    );
    let least = if common::in_vm() { 10 } else { 100 };
    assert!(ok > least, "the load ran ({ok} calls succeeded)");
    let mut seqs: HashMap<u64, Outcome> = HashMap::new();
    for (seq, o) in &outcomes {
        assert!(seqs.insert(*seq, *o).is_none(), "seq {seq:#x} called twice");
        let runs = ran.get(seq).copied().unwrap_or(0);
        match o {
            Outcome::Ok => assert_eq!(runs, 1, "call {seq:#x} succeeded: ran exactly once"),
            Outcome::NotExecuted => assert_eq!(runs, 0, "call {seq:#x} said not executed"),
            Outcome::MayHaveRun => assert!(runs <= 1, "call {seq:#x} ran {runs} times"),
        }
    }
    for (seq, runs) in &ran {
        assert!(seqs.contains_key(seq), "ran {seq:#x}, which no task called");
        assert_eq!(*runs, 1, "seq {seq:#x} ran {runs} times");
    }
    // Only the calls in flight on the killed replica may fail, at most one per task; the
    // drain moved every refused call elsewhere.
    assert!(
        not_run + maybe <= TASKS as usize,
        "{not_run} + {maybe} failures: more than the calls in flight on r0"
    );
}
