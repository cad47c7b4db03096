//! DNS names in a balanced channel, with a fake resolver (crate-internal: `Lookup`) in front
//! of real loopback servers: a name of three addresses is three replicas; a re-resolution
//! that drops one removes it while calls run, none failing; one that adds one starts using
//! it; a failed lookup keeps the set; calls that find the name's replicas all unreachable
//! make it be looked up again, at most once per gap; the first lookup is waited for (bounded)
//! and its failure is a clear not-executed UNAVAILABLE; the task ends with the channel.
//! Every wait is bounded.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::dns::Lookup;
use super::{Balancer, Channel, Target};
use crate::server::{Dispatched, IncomingCall, RunningServer, Server, Service};
use crate::{CallKind, Code, MethodDesc, Request, Response, Status};

#[derive(Clone, PartialEq, prost::Message)]
struct Num {
    #[prost(uint64, tag = "1")]
    seq: u64,
}

static ECHO: MethodDesc = MethodDesc::new("/dns.Echo/Echo", CallKind::Unary);
static METHODS: [MethodDesc; 1] = [ECHO];

struct EchoSvc(Arc<AtomicU64>);

impl Service for EchoSvc {
    fn name(&self) -> &'static str {
        "dns.Echo"
    }
    fn methods(&self) -> &'static [MethodDesc] {
        &METHODS
    }
    fn call(&self, _method: u32, call: IncomingCall<'_>) -> Dispatched {
        let calls = Arc::clone(&self.0);
        call.unary(move |req: Request<Num>| async move {
            calls.fetch_add(1, Ordering::AcqRel);
            Ok(Response::new(req.into_inner()))
        })
    }
}

struct Echo {
    server: RunningServer,
    calls: Arc<AtomicU64>,
}

impl Echo {
    async fn start() -> Echo {
        let calls = Arc::new(AtomicU64::new(0));
        let server = tokio::time::timeout(
            Duration::from_secs(20),
            Server::builder()
                .add_service(EchoSvc(Arc::clone(&calls)))
                .bind("127.0.0.1:0"),
        )
        .await
        .expect("bind in time")
        .expect("bind");
        Echo { server, calls }
    }
    fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }
    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Acquire)
    }
}

/// A resolver whose answer the test sets, counting lookups.
struct Fake {
    answer: Mutex<Result<Vec<SocketAddr>, String>>,
    lookups: AtomicUsize,
    /// How long each lookup takes.
    delay: Duration,
}

impl Fake {
    fn new(addrs: Vec<SocketAddr>, delay: Duration) -> Arc<Fake> {
        Arc::new(Fake {
            answer: Mutex::new(Ok(addrs)),
            lookups: AtomicUsize::new(0),
            delay,
        })
    }
    fn set(&self, answer: Result<Vec<SocketAddr>, String>) {
        *self.answer.lock().unwrap() = answer;
    }
    fn lookups(&self) -> usize {
        self.lookups.load(Ordering::Acquire)
    }
    fn lookup(self: &Arc<Self>) -> Lookup {
        let me = Arc::clone(self);
        Arc::new(move |name: String| {
            let me = Arc::clone(&me);
            Box::pin(async move {
                assert_eq!(name, NAME, "the name is looked up as host:port");
                tokio::time::sleep(me.delay).await;
                me.lookups.fetch_add(1, Ordering::AcqRel);
                me.answer.lock().unwrap().clone().map_err(io::Error::other)
            })
        })
    }
}

const NAME: &str = "svc.test:7";
const LIMIT: Duration = Duration::from_secs(30);

/// A balanced channel over `NAME` resolved by `fake`, every `every`, at most once per `gap`
/// when its replicas are all unreachable.
fn channel(fake: &Arc<Fake>, every: Duration, gap: Duration) -> (Channel, Balancer) {
    channel_with(fake, every, gap, Duration::from_secs(5))
}

fn channel_with(
    fake: &Arc<Fake>,
    every: Duration,
    gap: Duration,
    connect_timeout: Duration,
) -> (Channel, Balancer) {
    let (ch, balancer) = Channel::balance_channel();
    let Target::Many(b) = &ch.target else {
        unreachable!()
    };
    let builder = Channel::builder(format!("http://{NAME}/")).connect_timeout(connect_timeout);
    b.resolve_with(builder, every, gap, fake.lookup()).unwrap();
    (ch, balancer)
}

async fn call(ch: &Channel, seq: u64) -> Result<u64, Status> {
    let mut req = Request::new(Num { seq });
    req.set_timeout(Duration::from_secs(20));
    let r = tokio::time::timeout(LIMIT, ch.unary::<Num, Num>(&ECHO, req))
        .await
        .map_err(|_| Status::deadline_exceeded("no answer in 30 s"))??;
    assert_eq!(r.get_ref().seq, seq);
    Ok(seq)
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < LIMIT, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn key(a: SocketAddr) -> String {
    format!("{NAME}/{a}")
}

fn sorted(mut v: Vec<String>) -> Vec<String> {
    v.sort();
    v
}

/// Callers that keep calling until stopped; the number of calls made and of failures.
struct Callers {
    stop: Arc<AtomicBool>,
    /// Calls each caller finished so far.
    done: Arc<Vec<AtomicU64>>,
    tasks: Vec<tokio::task::JoinHandle<(u64, Vec<Status>)>>,
}

impl Callers {
    fn start(ch: &Channel, n: u64) -> Callers {
        let stop = Arc::new(AtomicBool::new(false));
        let done: Arc<Vec<AtomicU64>> = Arc::new((0..n).map(|_| AtomicU64::new(0)).collect());
        let tasks = (0..n)
            .map(|k| {
                let (ch, stop, done) = (ch.clone(), Arc::clone(&stop), Arc::clone(&done));
                tokio::spawn(async move {
                    let (mut made, mut failed) = (0u64, Vec::new());
                    while !stop.load(Ordering::Acquire) && made < 100_000 {
                        if let Err(st) = call(&ch, k * 1_000_000 + made).await {
                            failed.push(st);
                        }
                        made += 1;
                        done[k as usize].store(made, Ordering::Release);
                    }
                    (made, failed)
                })
            })
            .collect();
        Callers { stop, done, tasks }
    }

    /// Calls each caller finished so far.
    fn progress(&self) -> Vec<u64> {
        self.done
            .iter()
            .map(|d| d.load(Ordering::Acquire))
            .collect()
    }

    /// Waits until every caller finished two more calls than at `since`: the call each had
    /// in flight at `since` (picked from the replicas as they were then) is over.
    async fn all_moved_on(&self, since: &[u64]) {
        wait_until("every caller finished two more calls", || {
            self.progress()
                .iter()
                .zip(since)
                .all(|(now, then)| *now >= then + 2)
        })
        .await;
    }

    async fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Release);
        let mut total = 0;
        for t in self.tasks {
            let (made, failed) = tokio::time::timeout(LIMIT, t).await.unwrap().unwrap();
            assert!(
                failed.is_empty(),
                "{} calls failed: {failed:?}",
                failed.len()
            );
            total += made;
        }
        total
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_of_three_addresses_is_three_replicas_and_calls_use_each() {
    let s = [
        Echo::start().await,
        Echo::start().await,
        Echo::start().await,
    ];
    let fake = Fake::new(s.iter().map(Echo::addr).collect(), Duration::ZERO);
    let (ch, balancer) = channel(&fake, Duration::from_secs(3600), Duration::from_secs(1));
    // The first call waits for the first lookup.
    call(&ch, 0).await.unwrap();
    assert_eq!(
        sorted(balancer.keys()),
        sorted(s.iter().map(|e| key(e.addr())).collect())
    );
    let callers = Callers::start(&ch, 6);
    wait_until("each replica took calls", || {
        s.iter().all(|e| e.calls() >= 20)
    })
    .await;
    callers.stop().await;
    assert_eq!(fake.lookups(), 1, "no lookup but the first within `every`");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_resolution_that_drops_an_address_removes_it_while_calls_run() {
    let s = [
        Echo::start().await,
        Echo::start().await,
        Echo::start().await,
    ];
    let fake = Fake::new(s.iter().map(Echo::addr).collect(), Duration::ZERO);
    let (ch, balancer) = channel(&fake, Duration::from_millis(100), Duration::from_millis(50));
    call(&ch, 0).await.unwrap();
    let callers = Callers::start(&ch, 6);
    wait_until("each replica took calls", || {
        s.iter().all(|e| e.calls() >= 10)
    })
    .await;
    // The name no longer has the third address.
    fake.set(Ok(vec![s[0].addr(), s[1].addr()]));
    wait_until("the replica is removed", || balancer.keys().len() == 2).await;
    assert!(!balancer.keys().contains(&key(s[2].addr())));
    // Calls in flight there (picked before the removal, by callers a loaded host may hold
    // back for long) are over once every caller finished two more calls.
    let since = callers.progress();
    callers.all_moved_on(&since).await;
    let others = || s[0].calls() + s[1].calls();
    let gone = s[2].calls();
    let before = others();
    wait_until("more calls go on elsewhere", || others() >= before + 200).await;
    let made = callers.stop().await;
    assert_eq!(s[2].calls(), gone, "no call goes to a removed address");
    assert!(made > 100);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_resolution_that_adds_an_address_starts_using_it() {
    let s = [Echo::start().await, Echo::start().await];
    let fake = Fake::new(vec![s[0].addr()], Duration::ZERO);
    let (ch, balancer) = channel(&fake, Duration::from_millis(100), Duration::from_millis(50));
    call(&ch, 0).await.unwrap();
    assert_eq!(balancer.keys(), vec![key(s[0].addr())]);
    let callers = Callers::start(&ch, 4);
    fake.set(Ok(vec![s[1].addr(), s[0].addr()]));
    wait_until("the new address takes calls", || s[1].calls() >= 20).await;
    callers.stop().await;
    assert_eq!(
        sorted(balancer.keys()),
        sorted(vec![key(s[0].addr()), key(s[1].addr())])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_lookup_keeps_the_last_set() {
    let s = [Echo::start().await, Echo::start().await];
    let fake = Fake::new(s.iter().map(Echo::addr).collect(), Duration::ZERO);
    let (ch, balancer) = channel(&fake, Duration::from_millis(50), Duration::from_millis(50));
    call(&ch, 0).await.unwrap();
    let keys = sorted(balancer.keys());
    let callers = Callers::start(&ch, 4);
    fake.set(Err("SERVFAIL".into()));
    let n = fake.lookups();
    wait_until("three failed lookups", || fake.lookups() >= n + 3).await;
    assert_eq!(sorted(balancer.keys()), keys);
    // An empty answer is a failure too.
    fake.set(Ok(Vec::new()));
    let n = fake.lookups();
    wait_until("two empty lookups", || fake.lookups() >= n + 2).await;
    assert_eq!(sorted(balancer.keys()), keys);
    callers.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_that_find_the_name_unreachable_look_it_up_again_at_most_once_per_gap() {
    let gone = Echo::start().await;
    let dead = gone.addr();
    tokio::time::timeout(LIMIT, gone.server.shutdown())
        .await
        .unwrap();
    let fake = Fake::new(vec![dead], Duration::ZERO);
    let gap = Duration::from_millis(300);
    let (ch, balancer) = channel(&fake, Duration::from_secs(3600), gap);
    let st = call(&ch, 0).await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    // Failing calls for a while: lookups again, but at most one per gap (and the first).
    let start = Instant::now();
    let mut i = 0;
    while start.elapsed() < Duration::from_millis(1200) {
        i += 1;
        assert!(call(&ch, i).await.is_err());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let n = fake.lookups();
    let most = 1 + (start.elapsed().as_millis() / gap.as_millis()) as usize + 1;
    assert!(n >= 2 && n <= most, "{n} lookups in {:?}", start.elapsed());
    // The service moved: the next failing calls find it.
    let s = Echo::start().await;
    fake.set(Ok(vec![s.addr()]));
    let start = Instant::now();
    loop {
        i += 1;
        if call(&ch, i).await.is_ok() {
            break;
        }
        assert!(start.elapsed() < LIMIT, "the moved service was never found");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(balancer.keys(), vec![key(s.addr())]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_first_lookup_is_a_clear_not_executed_unavailable() {
    let fake = Fake::new(Vec::new(), Duration::from_millis(50));
    fake.set(Err("no such host".into()));
    let (ch, _balancer) = channel(&fake, Duration::from_secs(3600), Duration::from_secs(1));
    let st = call(&ch, 0).await.unwrap_err();
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(st.is_not_executed(), "{st:?}");
    assert!(
        st.message().contains(NAME) && st.message().contains("no such host"),
        "the status names the name and the error: {st:?}"
    );

    // A lookup that never answers: the call waits no longer than the connect timeout.
    let fake = Fake::new(Vec::new(), Duration::from_secs(3600));
    let t = Duration::from_millis(300);
    let (ch, _balancer) = channel_with(&fake, Duration::from_secs(3600), Duration::from_secs(1), t);
    let start = Instant::now();
    let st = call(&ch, 0).await.unwrap_err();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(st.code(), Code::Unavailable, "{st:?}");
    assert!(st.is_not_executed(), "{st:?}");
    assert!(st.message().contains(NAME), "{st:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_task_ends_when_the_channel_is_dropped() {
    let s = Echo::start().await;
    let fake = Fake::new(vec![s.addr()], Duration::ZERO);
    // Looked up once an hour: the task must end on the drop, not at its next lookup.
    let (ch, balancer) = channel(&fake, Duration::from_secs(3600), Duration::from_secs(1));
    call(&ch, 0).await.unwrap();
    let task_holds = Arc::downgrade(&fake);
    drop(fake);
    assert!(
        task_holds.upgrade().is_some(),
        "the task holds the resolver"
    );
    let ch2 = ch.clone();
    drop(ch);
    drop(balancer);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(task_holds.upgrade().is_some(), "a clone keeps the channel");
    drop(ch2);
    wait_until("the task ended", || task_holds.upgrade().is_none()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_name_stops_it_and_removes_its_replicas() {
    let s = Echo::start().await;
    let fake = Fake::new(vec![s.addr()], Duration::ZERO);
    let (ch, balancer) = channel(&fake, Duration::from_millis(50), Duration::from_millis(50));
    balancer.insert("other", Channel::builder(s.addr().to_string()));
    call(&ch, 0).await.unwrap();
    // The call may have gone to "other" before the name's first lookup ended (a call waits
    // for a lookup only when there is no replica at all).
    wait_until("the name resolved", || balancer.keys().len() == 2).await;
    let task_holds = Arc::downgrade(&fake);
    drop(fake);
    balancer.remove(&format!("http://{NAME}"));
    assert_eq!(balancer.keys(), vec!["other".to_string()]);
    wait_until("the task ended", || task_holds.upgrade().is_none()).await;
    call(&ch, 1).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_where_nothing_listens_is_ejected_harmlessly() {
    // As `localhost` resolving to both 127.0.0.1 and ::1 with the server on 127.0.0.1 only.
    let s = Echo::start().await;
    let v6 = SocketAddr::new(std::net::Ipv6Addr::LOCALHOST.into(), s.addr().port());
    let fake = Fake::new(vec![s.addr(), v6], Duration::ZERO);
    let (ch, balancer) = channel(&fake, Duration::from_secs(3600), Duration::from_secs(1));
    let callers = Callers::start(&ch, 4);
    wait_until("calls ran", || s.calls() >= 200).await;
    callers.stop().await;
    assert_eq!(
        sorted(balancer.keys()),
        sorted(vec![key(s.addr()), key(v6)])
    );
}
