//! Keepalive: an idle connection notices a dead link or a vanished peer (TCP keepalive on the
//! bootstrap connection, `ChannelBuilder::keep_alive_*` and `ServerBuilder::keep_alive_*`).
//!
//! A dead link cannot be played by a stopped process (its kernel still answers the probes)
//! nor by a proxy that stops forwarding (the proxy's kernel answers them): the probes must go
//! unanswered on the wire. So the dead-link test builds a small network on this host, as
//! root: the client in this process's namespace, the server in a namespace of its own (a
//! thread of this process moved there), a router namespace between them, and it cuts the
//! path with blackhole routes in the router: packets in both directions vanish silently,
//! with no error at either end, as when a cable is cut or a host is powered off. Without
//! root or `ip` it says so and passes; the healthy-connection test runs everywhere.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::fd::AsFd;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use rpc_core::{Channel, ClientPoller, Code, Request, Response, Status};

/// Client keepalive of these tests: first probe after 1 s of silence, dead after 2 s more
/// without an answer (a bound of 3 s).
const CLIENT_INTERVAL: Duration = Duration::from_secs(1);
const CLIENT_TIMEOUT: Duration = Duration::from_secs(2);
const CLIENT_BOUND: Duration = Duration::from_secs(3);
/// The server's, longer, so that the client notices first in the dead-link test (a bound of
/// 2 + 3 = 5 s): each side is seen to notice by itself.
const SERVER_INTERVAL: Duration = Duration::from_secs(2);
const SERVER_TIMEOUT: Duration = Duration::from_secs(3);
const SERVER_BOUND: Duration = Duration::from_secs(5);
/// Room for a loaded machine on top of the bounds.
const SLACK: Duration = Duration::from_secs(10);

/// A `lab.Lab/Sleep` call of `ms` without a deadline.
async fn long_call(ch: Channel, seq: u64, ms: u64) -> Result<Response<Blob>, Status> {
    let req = Request::new(SleepRequest {
        seq,
        ms,
        reply_len: 16,
        pad: pattern(16, seq),
    });
    ch.unary(&lab_server::SLEEP, req).await
}

/// Probes that are answered keep an idle connection, and a long call on it, alive: a call
/// without a deadline spanning several probe rounds completes, and so does one after a
/// silence of as long.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answered_probes_keep_a_quiet_connection() {
    let srv = TestServer::start_with(|b| {
        b.keep_alive_interval(CLIENT_INTERVAL)
            .keep_alive_timeout(CLIENT_TIMEOUT)
    })
    .await;
    let ch = within(
        Duration::from_secs(20),
        "connect",
        srv.builder()
            .keep_alive_interval(CLIENT_INTERVAL)
            .keep_alive_timeout(CLIENT_TIMEOUT)
            .connect(),
    )
    .await
    .expect("channel connects");
    echo_seq(&ch, 1).await;
    let quiet = CLIENT_BOUND + Duration::from_secs(2);
    let r = within(
        quiet + SLACK,
        "a long call",
        long_call(ch.clone(), 2, quiet.as_millis() as u64),
    )
    .await;
    check_blob(r.expect("the long call").get_ref(), 2, 16, "long call");
    tokio::time::sleep(quiet).await;
    echo_seq(&ch, 3).await;
    assert!(ch.is_connected());
    assert_eq!(srv.server.connections(), 1);
    // Off on both sides works the same while nothing breaks.
    let off = TestServer::start_with(|b| b.keep_alive_interval(None)).await;
    let ch = within(
        Duration::from_secs(20),
        "connect",
        off.builder().keep_alive_interval(None).connect(),
    )
    .await
    .expect("channel connects");
    echo_seq(&ch, 4).await;
}

/// The link dies under an idle connection whose only call is a long one without a deadline,
/// its request delivered: the call ends `UNAVAILABLE` naming keepalive within the client's
/// bound, and the server, noticing by itself within its own, closes the connection, drops the
/// handler and frees the connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_link_ends_an_idle_call_and_frees_the_server() {
    let Some(net) = Net::build() else { return };
    let (rt, srv) = net.serve(|b| {
        b.keep_alive_interval(SERVER_INTERVAL)
            .keep_alive_timeout(SERVER_TIMEOUT)
    });
    let addr = format!("{}:{}", net.server_ip, srv.server.local_addr().port());
    let ch = within(
        Duration::from_secs(20),
        "connect across the namespaces",
        Channel::builder(addr.clone())
            .poller(ClientPoller::Thread)
            .keep_alive_interval(CLIENT_INTERVAL)
            .keep_alive_timeout(CLIENT_TIMEOUT)
            .connect(),
    )
    .await
    .expect("channel connects");
    echo_seq(&ch, 1).await;
    let call = tokio::spawn(long_call(ch.clone(), 2, 600_000));
    wait_until(Duration::from_secs(20), "the handler starts", || {
        srv.state.sleeping() == 1
    })
    .await;
    assert_eq!(srv.server.connections(), 1);

    net.cut();
    let cut = Instant::now();
    let r = within(CLIENT_BOUND + SLACK, "the call across the dead link", call)
        .await
        .expect("call task");
    let client_took = cut.elapsed();
    let st = r.expect_err("a call across a dead link");
    assert_eq!(st.code(), Code::Unavailable, "{st}");
    assert!(
        st.message()
            .contains("keepalive: the server did not answer for 3 s"),
        "the status names keepalive and its bound: {st}"
    );
    assert!(
        client_took <= CLIENT_BOUND + SLACK,
        "the call failed {client_took:?} after the cut"
    );
    assert!(!ch.is_connected(), "the connection is closed");

    let server = &srv.server;
    wait_until(
        SERVER_BOUND + SLACK,
        "the server frees the connection",
        || server.connections() == 0 && server.live_calls() == 0,
    )
    .await;
    let server_took = cut.elapsed();
    wait_until(Duration::from_secs(5), "the handler is dropped", || {
        srv.state.sleeping() == 0
    })
    .await;
    assert_eq!(
        srv.state.dropped.load(std::sync::atomic::Ordering::Acquire),
        1
    );
    println!(
        "KEEPALIVE | dead link | client (bound {CLIENT_BOUND:?}): call without deadline \
         failed after {:.2} s: {}",
        client_took.as_secs_f64(),
        st.message()
    );
    println!(
        "KEEPALIVE | dead link | server (bound {SERVER_BOUND:?}): connection freed, handler \
         dropped after {:.2} s",
        server_took.as_secs_f64()
    );
    drop(ch);
    drop(srv);
    rt.shutdown_background();
}

// ----- a network of namespaces ----------------------------------------------------------------

/// `ip` (iproute2's, by absolute path), if installed.
fn ip_path() -> Option<&'static str> {
    ["/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
}

/// Runs `ip args` (bounded: killed after 10 s); its error output when it fails.
fn ip(args: &[&str]) -> Result<(), String> {
    let path = ip_path().ok_or("ip is not installed")?;
    let mut child = Command::new(path)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| format!("{path}: {e}"))?;
    let start = Instant::now();
    while child.try_wait().map_err(|e| e.to_string())?.is_none() {
        if start.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("ip {}: no result within 10 s", args.join(" ")));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// Client (this namespace) ── router namespace ── server namespace, on addresses of the
/// benchmarking range 198.18.0.0/15 picked from the process id; removed when dropped.
struct Net {
    router: String,
    server: String,
    client_dev: String,
    client_ip: String,
    server_ip: String,
}

impl Net {
    /// The network, or `None` (and a note) where this host cannot build one.
    fn build() -> Option<Net> {
        if !rustix::process::geteuid().is_root() || ip_path().is_none() {
            eprintln!("skipping: building network namespaces needs root and iproute2's ip");
            return None;
        }
        let pid = std::process::id();
        let idx = pid % 16_384;
        let base = format!("198.{}.{}", 18 + idx / 8_192, (idx / 32) % 256);
        let o = (idx % 32) * 8;
        let net = Net {
            router: format!("rpcka{pid}r"),
            server: format!("rpcka{pid}s"),
            client_dev: format!("ka{pid}c"),
            client_ip: format!("{base}.{}", o + 1),
            server_ip: format!("{base}.{}", o + 6),
        };
        net.remove();
        match net.create(&base, o) {
            Ok(()) => Some(net),
            Err(e) => {
                eprintln!("skipping: this host cannot build network namespaces: {e}");
                None
            }
        }
    }

    fn create(&self, base: &str, o: u32) -> Result<(), String> {
        let (r, s, c) = (&self.router, &self.server, &self.client_dev);
        // Interface names (at most 15 bytes): ka<pid>c ── ka<pid>cr | ka<pid>sr ── ka<pid>s.
        let rc = format!("{c}r");
        let sv = format!("ka{}s", std::process::id());
        let rs = format!("{sv}r");
        let (rs, sv) = (rs.as_str(), sv.as_str());
        let router_c = format!("{base}.{}", o + 2);
        let router_s = format!("{base}.{}", o + 5);
        let client_net = format!("{base}.{}/30", o);
        let server_net = format!("{base}.{}/30", o + 4);
        ip(&["netns", "add", r])?;
        ip(&["netns", "add", s])?;
        ip(&["link", "add", c, "type", "veth", "peer", "name", &rc])?;
        ip(&["link", "set", &rc, "netns", r])?;
        ip(&["link", "add", rs, "type", "veth", "peer", "name", sv])?;
        ip(&["link", "set", rs, "netns", r])?;
        ip(&["link", "set", sv, "netns", s])?;
        ip(&["addr", "add", &format!("{}/30", self.client_ip), "dev", c])?;
        ip(&["link", "set", c, "up"])?;
        ip(&[
            "-n",
            r,
            "addr",
            "add",
            &format!("{router_c}/30"),
            "dev",
            &rc,
        ])?;
        ip(&["-n", r, "addr", "add", &format!("{router_s}/30"), "dev", rs])?;
        ip(&["-n", r, "link", "set", &rc, "up"])?;
        ip(&["-n", r, "link", "set", rs, "up"])?;
        ip(&[
            "-n",
            s,
            "addr",
            "add",
            &format!("{}/30", self.server_ip),
            "dev",
            sv,
        ])?;
        ip(&["-n", s, "link", "set", sv, "up"])?;
        ip(&["-n", s, "link", "set", "lo", "up"])?;
        ip(&["route", "add", &server_net, "via", &router_c])?;
        ip(&["-n", s, "route", "add", &client_net, "via", &router_s])?;
        in_netns(r, || {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
                .map_err(|e| format!("forwarding in the router namespace: {e}"))
        })?
    }

    /// Starts a lab server configured by `f` in the server namespace; its runtime's threads
    /// (and the shard's) live there.
    fn serve(
        &self,
        f: impl FnOnce(rpc_core::ServerBuilder) -> rpc_core::ServerBuilder + Send + 'static,
    ) -> (tokio::runtime::Runtime, TestServer) {
        let addr = format!("{}:0", self.server_ip);
        in_netns(&self.server, move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            let srv = rt.block_on(TestServer::bind_with(&addr, f));
            (rt, srv)
        })
        .expect("a server in its namespace")
    }

    /// The link dies: the router drops every packet between client and server, silently.
    fn cut(&self) {
        for ip_ in [&self.server_ip, &self.client_ip] {
            ip(&[
                "-n",
                &self.router,
                "route",
                "add",
                "blackhole",
                &format!("{ip_}/32"),
            ])
            .expect("blackhole route");
        }
    }

    fn remove(&self) {
        // Deleting the namespaces deletes their ends of the veth pairs, and so the client's.
        let _ = ip(&["netns", "del", &self.router]);
        let _ = ip(&["netns", "del", &self.server]);
        let _ = ip(&["link", "del", &self.client_dev]);
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Runs `f` on a thread of its own moved into network namespace `ns`.
fn in_netns<T: Send + 'static>(
    ns: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, String> {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
        rustix::thread::move_into_link_name_space(
            fd.as_fd(),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(|e| format!("setns({path}): {e}"))?;
        Ok(f())
    })
    .join()
    .map_err(|_| format!("the thread in {ns} panicked"))?
}
