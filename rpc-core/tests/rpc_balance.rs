//! A channel over replicas (`Channel::balance_list`, `Channel::balance_channel`): calls
//! spread over the replicas, a replica that goes away is ejected and the calls move on with
//! none failing, replicas are added and removed while calls run, and blocking calls,
//! pipelines and generated clients work on it; a DNS name (`localhost:PORT`) stands for the
//! replicas of its addresses, dialled by IP, and a name that does not resolve fails calls
//! with a clear not-executed UNAVAILABLE. Runs on every provider.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Blob, TestServer, lab_server, pattern, within};
use rpc_core::{Channel, Code, Request, Status};

const LIMIT: Duration = Duration::from_secs(60);

fn blob(seq: u64) -> Request<Blob> {
    Request::new(Blob {
        seq,
        data: pattern(16, seq),
    })
}

async fn echo(ch: &Channel, seq: u64) -> Result<(), rpc_core::Status> {
    let r = within(
        LIMIT,
        "echo",
        ch.unary::<_, Blob>(&lab_server::ECHO, blob(seq)),
    )
    .await?;
    assert_eq!(r.get_ref().seq, seq);
    Ok(())
}

fn served(s: &TestServer) -> u64 {
    s.state.calls.load(Ordering::Acquire)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_spread_and_survive_a_replica_going_away() {
    let servers = [
        TestServer::start().await,
        TestServer::start().await,
        TestServer::start().await,
    ];
    let ch = Channel::balance_list(servers.iter().map(TestServer::addr));
    // Concurrent calls: each replica takes a share.
    let mut tasks = Vec::new();
    for k in 0..8u64 {
        let ch = ch.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..40u64 {
                echo(&ch, k * 1000 + i).await.unwrap();
            }
        }));
    }
    for t in tasks {
        within(LIMIT, "callers", t).await.unwrap();
    }
    let counts: Vec<u64> = servers.iter().map(served).collect();
    assert_eq!(counts.iter().sum::<u64>(), 320, "{counts:?}");
    for (i, n) in counts.iter().enumerate() {
        assert!(*n >= 32, "replica {i} took {n} of 320 calls: {counts:?}");
    }

    // One replica goes away (drained): calls keep succeeding on the others, none fails.
    let [a, b, c] = servers;
    let before = (served(&a), served(&b));
    within(LIMIT, "shutdown", c.server.shutdown()).await;
    for i in 0..200u64 {
        echo(&ch, 10_000 + i)
            .await
            .unwrap_or_else(|st| panic!("call {i} failed after a replica left: {st:?}"));
    }
    assert_eq!(served(&a) + served(&b) - before.0 - before.1, 200);

    // Blocking calls and pipelines work on the balanced channel too.
    let bch = ch.clone();
    tokio::task::spawn_blocking(move || {
        for i in 0..20u64 {
            let r = bch
                .unary_blocking::<_, Blob>(&lab_server::ECHO, blob(20_000 + i))
                .unwrap();
            assert_eq!(r.get_ref().seq, 20_000 + i);
        }
        let mut p = bch.pipeline::<Blob, Blob>(&lab_server::ECHO).unwrap();
        for i in 0..10u64 {
            p.submit(i, blob(30_000 + i)).unwrap();
        }
        for _ in 0..10 {
            let (tag, r) = p.wait().expect("a finished call");
            assert_eq!(r.unwrap().get_ref().seq, 30_000 + tag);
        }
    })
    .await
    .unwrap();
    // A generated client takes it unchanged.
    let client = common::lab_client::LabClient::new(ch.clone());
    let r = within(LIMIT, "generated", client.echo(Blob::default()))
        .await
        .unwrap();
    assert_eq!(r.into_inner().seq, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_come_and_go_while_calls_run() {
    let a = TestServer::start().await;
    let (ch, balancer) = Channel::balance_channel();
    // No replica yet: a clear failure.
    let st = echo(&ch, 1).await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable);
    assert!(st.message().contains("no replica"), "{st:?}");

    balancer.insert("a", Channel::builder(a.addr()));
    for i in 0..20 {
        echo(&ch, i).await.unwrap();
    }
    assert_eq!(served(&a), 20);

    let b = TestServer::start().await;
    balancer.insert("b", Channel::builder(b.addr()));
    assert_eq!(balancer.keys(), vec!["a".to_string(), "b".to_string()]);
    for i in 0..100 {
        echo(&ch, 100 + i).await.unwrap();
    }
    assert!(
        served(&b) >= 20,
        "the new replica takes calls: {}",
        served(&b)
    );

    balancer.remove("a");
    let a_before = served(&a);
    for i in 0..50 {
        echo(&ch, 300 + i).await.unwrap();
    }
    assert_eq!(served(&a), a_before, "no call goes to a removed replica");

    // Every replica down: UNAVAILABLE naming them, at once; back once one returns.
    let addr_b = b.addr();
    within(LIMIT, "shutdown", b.server.shutdown()).await;
    let st = echo(&ch, 400).await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(st.message().contains("no replica can be reached"), "{st:?}");
    assert!(
        st.message().contains("b:"),
        "the status names the replica: {st:?}"
    );
    let c = TestServer::start().await;
    balancer.insert("c", Channel::builder(c.addr()));
    echo(&ch, 401).await.unwrap();
    assert_eq!(served(&c), 1);
    drop(addr_b);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_name_is_the_replicas_of_its_addresses() {
    let a = TestServer::start().await;
    let b = TestServer::start().await;
    let port = a.server.local_addr().port();
    let name = format!("localhost:{port}");
    let ch = Channel::balance_list([format!("http://{name}"), b.addr()]);
    // The first call waits for the name's first lookup (here a blocking one).
    let bch = ch.clone();
    let r = tokio::task::spawn_blocking(move || {
        bch.unary_blocking::<_, Blob>(&lab_server::ECHO, blob(1))
    });
    assert_eq!(
        within(LIMIT, "blocking", r)
            .await
            .unwrap()
            .unwrap()
            .get_ref()
            .seq,
        1
    );
    // localhost may also resolve to ::1, where nothing listens: that replica is ejected
    // harmlessly and no call fails.
    for i in 0..200 {
        echo(&ch, 100 + i).await.unwrap();
    }
    assert_eq!(served(&a) + served(&b), 201);
    assert!(
        served(&a) >= 20,
        "the name's replica takes calls: {}",
        served(&a)
    );
    let dbg = format!("{ch:?}");
    assert!(
        dbg.contains(&format!("{name}/127.0.0.1:{port}")),
        "one replica per address, dialled by IP: {dbg}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_that_does_not_resolve_fails_calls_not_executed() {
    let (ch, balancer) = Channel::balance_channel();
    let name = "no-such-host.invalid:50051";
    balancer
        .resolve(
            Channel::builder(name).connect_timeout(Duration::from_secs(2)),
            Duration::from_secs(30),
        )
        .unwrap();
    let r: Result<(), Status> = echo(&ch, 1).await;
    let st = r.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(st.is_not_executed(), "{st:?}");
    assert!(
        st.message().contains(name),
        "the status names the name: {st:?}"
    );
    assert!(balancer.keys().is_empty());
    // Not an address at all: refused at once.
    assert!(
        balancer
            .resolve(Channel::builder("https://h:1"), Duration::from_secs(30))
            .is_err()
    );
}
