//! Microservices on the default provider: a frontend whose handler calls three replicas of a
//! backend (nested calls through a balanced channel), and a client driving the frontend from
//! 16 tasks. During the run one backend is killed (SIGKILL), one drained (SIGTERM: it finishes
//! what it has and refuses the rest unexecuted) and one added; the client should see no failed
//! call. At the end the call statistics of every side are printed.
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin microservices
//! ```
//!
//! The backends are child processes of this one (`microservices backend`); `Score` is declared
//! idempotent in `proto/mesh.proto`, so a call whose backend died under it is retried on
//! another replica, and one refused by a draining backend never ran and moves elsewhere.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use rpc_core::{Balancer, Channel, Request, Response, RetryPolicy, Server, Status};
use rpc_examples::mesh::backend_client::BackendClient;
use rpc_examples::mesh::backend_server::{Backend, BackendServer};
use rpc_examples::mesh::frontend_client::FrontendClient;
use rpc_examples::mesh::frontend_server::{Frontend, FrontendServer};
use rpc_examples::mesh::{Answer, Query, Score};

/// Client tasks calling the frontend at once.
const TASKS: u64 = 16;

/// The backend: a score from the query's text, after a little work (so that calls are in
/// flight when a replica dies).
struct Scorer {
    name: String,
    served: Arc<AtomicU64>,
}

impl Backend for Scorer {
    async fn score(&self, request: Request<Query>) -> Result<Response<Score>, Status> {
        let q = request.into_inner();
        tokio::time::sleep(Duration::from_micros(500)).await;
        self.served.fetch_add(1, Ordering::Relaxed);
        let score = q
            .text
            .bytes()
            .fold(q.id, |h, b| h.rotate_left(5) ^ u64::from(b));
        Ok(Response::new(Score {
            id: q.id,
            score,
            replica: self.name.clone(),
        }))
    }
}

/// The frontend: asks a backend replica, answers with what it said.
struct Front {
    backends: BackendClient,
}

impl Frontend for Front {
    async fn handle(&self, request: Request<Query>) -> Result<Response<Answer>, Status> {
        let s = self
            .backends
            .score(request.into_inner())
            .await?
            .into_inner();
        Ok(Response::new(Answer {
            id: s.id,
            score: s.score,
            replica: s.replica,
        }))
    }
}

/// `microservices backend NAME`: serves the backend on a free port, prints `listening ADDR`,
/// drains and exits on SIGTERM, dies with its parent.
async fn backend(name: String) -> Result<()> {
    // SAFETY: prctl with PR_SET_PDEATHSIG only sets a flag of this process.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
    }
    let served = Arc::new(AtomicU64::new(0));
    let server = Server::builder()
        .add_service(BackendServer::new(Scorer {
            name: name.clone(),
            served: Arc::clone(&served),
        }))
        .shutdown_grace(Duration::from_secs(5))
        .bind("127.0.0.1:0")
        .await?;
    println!("listening {}", server.local_addr());
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    term.recv().await;
    let live = server.live_calls();
    server.shutdown().await;
    println!(
        "{name}: drained ({live} calls were in flight), served {} calls",
        served.load(Ordering::Relaxed)
    );
    Ok(())
}

/// A backend child process and its address.
struct Replica {
    name: String,
    child: Child,
    addr: String,
    out: BufReader<std::process::ChildStdout>,
}

fn spawn_backend(name: &str) -> Result<Replica> {
    let mut child = Command::new(std::env::current_exe()?)
        .args(["backend", name])
        .stdout(Stdio::piped())
        .spawn()
        .context("start a backend")?;
    let mut out = BufReader::new(child.stdout.take().context("backend stdout")?);
    let mut line = String::new();
    out.read_line(&mut line)?;
    let Some(addr) = line.trim().strip_prefix("listening ") else {
        bail!("backend {name} said {line:?}");
    };
    println!("backend {name}: pid {} listening on {addr}", child.id());
    Ok(Replica {
        name: name.to_string(),
        addr: addr.to_string(),
        child,
        out,
    })
}

impl Replica {
    fn add_to(&self, balancer: &Balancer) {
        balancer.insert(self.name.clone(), Channel::builder(self.addr.clone()));
    }

    fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, sig);
        }
    }

    /// Waits for the child to exit and prints its last words.
    fn reap(mut self) {
        let _ = self.child.wait();
        let mut rest = String::new();
        while self.out.read_line(&mut rest).is_ok_and(|n| n > 0) {}
        for l in rest.lines() {
            println!("backend {l}");
        }
    }
}

#[derive(Default)]
struct Tally {
    ok: AtomicU64,
    failed: AtomicU64,
}

#[tokio::main]
async fn main() -> Result<()> {
    // Warnings only (the run's story is printed); RUST_LOG=info shows every connection.
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("backend") {
        return backend(args.get(2).cloned().unwrap_or_else(|| "backend".into())).await;
    }

    let replicas: Vec<Replica> = ["b1", "b2", "b3"]
        .iter()
        .map(|n| spawn_backend(n))
        .collect::<Result<_>>()?;
    let (to_backends, balancer) = Channel::balance_channel();
    for r in &replicas {
        r.add_to(&balancer);
    }
    // Calls that may have run are retried (Score is idempotent); refused ones always are.
    let to_backends = to_backends
        .with_retry_policy(RetryPolicy::new().max_attempts(4))
        .with_stats();
    let frontend = Server::builder()
        .add_service(FrontendServer::new(Front {
            backends: BackendClient::new(to_backends.clone()),
        }))
        .stats(true)
        .bind("127.0.0.1:0")
        .await?;
    println!("frontend: listening on {}", frontend.local_addr());
    let client_channel = Channel::connect(frontend.local_addr().to_string())
        .await?
        .with_stats();
    let client = FrontendClient::new(client_channel.clone());

    let tally = Arc::new(Tally::default());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let (client, tally, stop) = (client.clone(), Arc::clone(&tally), Arc::clone(&stop));
        tasks.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                let q = Query {
                    id: t << 32 | i,
                    text: format!("query {i} of task {t}"),
                };
                match client.handle(q).await {
                    Ok(_) => tally.ok.fetch_add(1, Ordering::Relaxed),
                    Err(st) => {
                        eprintln!("client: call failed: {st}");
                        tally.failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
                i += 1;
            }
        }));
    }

    let start = Instant::now();
    let at = |secs: f64| tokio::time::sleep_until((start + Duration::from_secs_f64(secs)).into());
    let report = |what: &str| {
        println!(
            "{:>5.2} s  {what:<44} calls ok {:>7}, failed {}",
            start.elapsed().as_secs_f64(),
            tally.ok.load(Ordering::Relaxed),
            tally.failed.load(Ordering::Relaxed)
        );
    };
    let mut replicas = replicas.into_iter();
    let (b1, b2, b3) = (
        replicas.next().context("b1")?,
        replicas.next().context("b2")?,
        replicas.next().context("b3")?,
    );
    report("running on b1, b2, b3");
    at(1.0).await;
    report("killing b1 (SIGKILL)");
    b1.signal(libc::SIGKILL);
    at(2.0).await;
    report("draining b2 (SIGTERM)");
    b2.signal(libc::SIGTERM);
    at(2.5).await;
    let b4 = spawn_backend("b4")?;
    b4.add_to(&balancer);
    report("added b4");
    at(4.0).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await?;
    }
    report("stopped");

    println!("\n{}\n", frontend.stats());
    println!(
        "{}  (the frontend's calls to the backends)\n",
        to_backends.stats()
    );
    println!(
        "{}  (the client's calls to the frontend)\n",
        client_channel.stats()
    );

    b3.signal(libc::SIGTERM);
    b4.signal(libc::SIGTERM);
    for b in [b1, b2, b3, b4] {
        b.reap();
    }
    frontend.shutdown().await;
    let failed = tally.failed.load(Ordering::Relaxed);
    if failed > 0 {
        bail!("{failed} calls failed");
    }
    println!("0 failed calls");
    Ok(())
}
