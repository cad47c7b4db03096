//! Runs a two-sided case with both sides in one process (two threads, two contexts), in two
//! processes (the test binary re-executes itself for side B), or in two hosts (side B started
//! by a peer server in the other host, see [`serve_peers`]), connected by a side channel.
//!
//! Every wait is bounded: side-channel reads time out, completion polls have deadlines, the
//! child process is killed if it outlives its budget. A bug fails the test; it never hangs CI.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use rpc_core::verbs::{
    Access, CompChannel, ConnectAttr, Context, Cq, Endpoint, ErrorKind, Mr, Pd, Provider, Qp,
    QpCaps, QpState, RecvWr, RemoteMr, SendFlags, SendWr, Sge, Wc, WcStatus, WrOp,
};

/// How long one side waits for the other on the side channel.
pub const LINK_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a completion may take in a case that expects one.
pub const WC_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a whole case may take.
pub const CASE_TIMEOUT: Duration = Duration::from_secs(90);

const ENV_ROLE: &str = "CONFORMANCE_PEER_ADDR";
const ENV_CASE: &str = "CONFORMANCE_PEER_CASE";
/// Side A of [`Mode::Remote`]: `ip:port` of the peer server in the other host.
pub const ENV_REMOTE: &str = "CONFORMANCE_REMOTE";
/// The peer server ([`serve_peers`]): the `ip:port` it listens on.
pub const ENV_SERVE: &str = "CONFORMANCE_SERVE";

/// Where side B runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Both sides in this process, on two threads, each with its own context.
    Threads,
    /// Side B in a child process (the test binary re-executed).
    Processes,
    /// Side B in a child process on another host: the peer server there ([`serve_peers`],
    /// at `CONFORMANCE_REMOTE`) starts it, and it connects back to this side. Without
    /// `CONFORMANCE_REMOTE` the cases of this mode skip (they need a second host).
    Remote,
}

/// Which side a case body runs as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The side the test runs on (parent process / main thread).
    A,
    /// The other side.
    B,
}

enum Link {
    Chan {
        tx: mpsc::Sender<Vec<u8>>,
        rx: mpsc::Receiver<Vec<u8>>,
    },
    Tcp(TcpStream),
}

impl Link {
    fn send(&mut self, msg: &[u8]) {
        match self {
            Link::Chan { tx, .. } => tx
                .send(msg.to_vec())
                .expect("side channel: the other side is gone (it failed)"),
            Link::Tcp(s) => {
                let len = (msg.len() as u32).to_le_bytes();
                s.write_all(&len)
                    .and_then(|_| s.write_all(msg))
                    .expect("side channel: the other side is gone (it failed)");
            }
        }
    }

    fn recv(&mut self) -> Vec<u8> {
        match self {
            Link::Chan { rx, .. } => rx
                .recv_timeout(LINK_TIMEOUT)
                .expect("side channel: timed out or the other side failed"),
            Link::Tcp(s) => {
                let mut len = [0u8; 4];
                s.read_exact(&mut len)
                    .expect("side channel: timed out or the other side failed");
                let mut b = vec![0u8; u32::from_le_bytes(len) as usize];
                s.read_exact(&mut b)
                    .expect("side channel: timed out or the other side failed");
                b
            }
        }
    }
}

/// One side of a running case: its context, its role and the side channel.
pub struct Side<P: Provider> {
    /// Which side this is.
    pub role: Role,
    /// Where the other side runs.
    pub mode: Mode,
    /// This side's open device.
    pub ctx: P::Context,
    link: Link,
    child: Option<Child>,
    /// [`Mode::Remote`]: the control connection to the peer server.
    peer_ctl: Option<TcpStream>,
}

impl<P: Provider> Side<P> {
    /// Sends a message to the other side.
    pub fn send(&mut self, msg: &[u8]) {
        self.link.send(msg);
    }

    /// Receives the other side's next message (bounded wait).
    pub fn recv(&mut self) -> Vec<u8> {
        self.link.recv()
    }

    /// Both sides reach this point before either continues.
    pub fn barrier(&mut self) {
        self.send(b"barrier");
        let m = self.recv();
        assert_eq!(m, b"barrier", "side channel out of step");
    }

    /// Exchanges endpoints.
    pub fn exchange_endpoint(&mut self, ep: &Endpoint) -> Endpoint {
        self.send(&ep.to_bytes());
        Endpoint::from_bytes(&self.recv()).expect("peer endpoint decodes")
    }

    /// Sends a remote region description.
    pub fn send_mr(&mut self, mr: &RemoteMr) {
        self.send(&mr.to_bytes());
    }

    /// Receives a remote region description.
    pub fn recv_mr(&mut self) -> RemoteMr {
        RemoteMr::from_bytes(&self.recv()).expect("remote MR decodes")
    }

    /// Kills the other side's process (SIGKILL). Only in [`Mode::Processes`] and
    /// [`Mode::Remote`], on side A.
    pub fn kill_peer(&mut self) {
        if let Some(ctl) = self.peer_ctl.as_mut() {
            ctl.write_all(b"kill\n")
                .expect("tell the peer server to kill side B");
            let st = read_line(ctl, CASE_TIMEOUT).expect("the peer server reports the kill");
            assert!(st.starts_with("exit "), "peer server: {st}");
            self.peer_ctl = None;
            return;
        }
        let mut c = self.child.take().expect("kill_peer needs a child process");
        c.kill().expect("SIGKILL the peer process");
        let _ = c.wait();
    }
}

/// A connected RC QP with its PD and CQ (send and receive on the same CQ).
pub struct Conn<P: Provider> {
    pub pd: P::Pd,
    pub cq: P::Cq,
    pub qp: P::Qp,
}

/// Options of [`connect`].
#[derive(Clone, Copy, Debug)]
pub struct Opts {
    pub caps: QpCaps,
    pub attr: ConnectAttr,
    pub cqe: u32,
}

impl Default for Opts {
    fn default() -> Self {
        Opts {
            caps: QpCaps {
                max_send_wr: 64,
                max_recv_wr: 64,
                max_send_sge: 4,
                max_recv_sge: 4,
                max_inline_data: 64,
            },
            attr: ConnectAttr::default(),
            cqe: 256,
        }
    }
}

/// Creates a PD, a CQ and a QP and connects it to the other side's (which calls `connect`
/// too), with a barrier at the end: both QPs are in RTS when it returns.
pub fn connect<P: Provider>(s: &mut Side<P>, o: Opts) -> Conn<P> {
    let pd = s.ctx.alloc_pd().expect("alloc_pd");
    connect_pd(s, pd, o)
}

/// [`connect`] with an existing PD.
pub fn connect_pd<P: Provider>(s: &mut Side<P>, pd: P::Pd, o: Opts) -> Conn<P> {
    let cq = s.ctx.create_cq(o.cqe, None).expect("create_cq");
    let mut qp = pd.create_qp(&cq, &cq, o.caps).expect("create_qp");
    qp.modify_to_init(o.attr.access).expect("modify_to_init");
    let remote = s.exchange_endpoint(&qp.endpoint());
    qp.connect(&remote, &o.attr).expect("connect");
    assert_eq!(qp.state(), QpState::Rts);
    s.barrier();
    Conn { pd, cq, qp }
}

/// Polls `cq` until `n` completions arrived or [`WC_TIMEOUT`] passed (then panics).
pub fn poll_n<C: Cq>(cq: &mut C, n: usize) -> Vec<Wc> {
    poll_n_for(cq, n, WC_TIMEOUT)
}

/// [`poll_n`] with a custom deadline.
pub fn poll_n_for<C: Cq>(cq: &mut C, n: usize, timeout: Duration) -> Vec<Wc> {
    let mut out = Vec::with_capacity(n);
    let mut buf = [Wc::default(); 16];
    let start = Instant::now();
    let mut spins = 0u32;
    while out.len() < n {
        let want = (n - out.len()).min(buf.len());
        let got = cq.poll(&mut buf[..want]).expect("poll_cq");
        out.extend_from_slice(&buf[..got]);
        if got == 0 {
            spins += 1;
            if spins > 200 {
                std::thread::sleep(Duration::from_micros(50));
            }
            if start.elapsed() > timeout {
                panic!(
                    "timed out after {timeout:?} waiting for {n} completions, got {}: {out:?}",
                    out.len()
                );
            }
        }
    }
    out
}

/// Polls `cq` for `d` and returns whatever arrived (for "nothing must arrive" checks).
pub fn poll_for<C: Cq>(cq: &mut C, d: Duration) -> Vec<Wc> {
    let mut out = Vec::new();
    let mut buf = [Wc::default(); 16];
    let start = Instant::now();
    while start.elapsed() < d {
        let got = cq.poll(&mut buf).expect("poll_cq");
        out.extend_from_slice(&buf[..got]);
        if got == 0 {
            std::thread::sleep(Duration::from_micros(100));
        }
    }
    out
}

/// Waits until `qp` reads `want`, for at most [`WC_TIMEOUT`] (then panics with `what`).
///
/// An error completion and the QP's move to ERROR are two steps in a real device: Soft-RoCE's
/// completer posts the error completion, then moves the QP (`rxe_comp.c`: `do_complete`, then
/// `rxe_qp_error`), so a query right after polling the completion can still read RTS.
pub fn assert_state_becomes<Q: Qp>(qp: &Q, want: QpState, what: &str) {
    let start = Instant::now();
    loop {
        let state = qp.state();
        if state == want {
            return;
        }
        assert!(
            start.elapsed() < WC_TIMEOUT,
            "{what}: QP state {state:?} after {WC_TIMEOUT:?}, expected {want:?}"
        );
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// Asserts a successful completion of `wr_id`.
pub fn assert_ok(wc: &Wc, wr_id: u64) {
    assert_eq!(wc.status, WcStatus::Success, "completion {wc:?}");
    assert_eq!(wc.wr_id, wr_id, "completion {wc:?}");
}

/// Posts one send work request (panics if refused).
pub fn post_send<Q: Qp>(qp: &mut Q, wr_id: u64, op: WrOp, sges: &[Sge], flags: SendFlags) {
    let wr = SendWr {
        wr_id,
        op,
        sg_list: sges,
        flags,
    };
    // SAFETY: every case keeps its regions alive and untouched until the completions are
    // polled (or the QP is in ERROR and flushed).
    unsafe { qp.post_send(std::slice::from_ref(&wr)) }.expect("post_send");
}

/// Posts one receive (panics if refused).
pub fn post_recv<Q: Qp>(qp: &mut Q, wr_id: u64, sges: &[Sge]) {
    let wr = RecvWr {
        wr_id,
        sg_list: sges,
    };
    // SAFETY: as in `post_send`.
    unsafe { qp.post_recv(std::slice::from_ref(&wr)) }.expect("post_recv");
}

/// A region with every right.
pub fn mr_all<P: Provider>(pd: &P::Pd, len: usize) -> P::Mr {
    pd.alloc_mr(len, Access::ALL).expect("alloc_mr")
}

/// The bytes of a region (copy).
pub fn read_mr<M: Mr>(mr: &M, off: usize, len: usize) -> Vec<u8> {
    assert!(off + len <= mr.len());
    let mut v = vec![0u8; len];
    // SAFETY: inside the region (checked); no work request targets it while a case reads.
    unsafe { std::ptr::copy_nonoverlapping(mr.as_ptr().add(off), v.as_mut_ptr(), len) };
    v
}

/// Asserts that `[off, off + len)` of a region holds only zero bytes (nothing was written).
pub fn assert_zeroed<M: Mr>(mr: &M, off: usize, len: usize, what: &str) {
    assert!(
        read_mr(mr, off, len).iter().all(|&b| b == 0),
        "{what}: bytes were written"
    );
}

/// Writes bytes into a region.
pub fn write_mr<M: Mr>(mr: &M, off: usize, data: &[u8]) {
    assert!(off + data.len() <= mr.len());
    // SAFETY: inside the region (checked); no work request targets it while a case writes.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), mr.as_ptr().add(off), data.len()) };
}

/// A deterministic byte pattern.
pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Whether a missing device must fail the suite instead of skipping it: inside the
/// Soft-RoCE VM (`softroce/vm.sh` exports `SOFTROCE=1`) or with `RPC_IB_REQUIRE_DEVICE=1`, so
/// that the suite can never pass there by skipping every case.
pub fn device_required() -> bool {
    std::env::var_os("SOFTROCE").is_some() || std::env::var_os("RPC_IB_REQUIRE_DEVICE").is_some()
}

/// Whether the provider is usable here; prints why not when it is not.
fn open_or_skip<P: Provider>() -> Option<P::Context> {
    match P::open(None) {
        Ok(c) => Some(c),
        Err(e) if e.kind() == ErrorKind::NoDevice && device_required() => panic!(
            "{}: no device, but one is required here (SOFTROCE or RPC_IB_REQUIRE_DEVICE is \
             set): {e}",
            P::NAME
        ),
        Err(e) if e.kind() == ErrorKind::NoDevice => {
            eprintln!("skipping: provider {} has no device here: {e}", P::NAME);
            None
        }
        Err(e) => panic!("{}: cannot open a device: {e}", P::NAME),
    }
}

struct KillOnDrop(Option<Child>);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut()
            && c.try_wait().ok().flatten().is_none()
        {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `case` as a two-sided test. `module` is the `module_path!()` of the generated test and
/// `name` the case name, which together name the test for the re-executed child.
pub fn run<P: Provider>(mode: Mode, module: &str, name: &str, case: fn(&mut Side<P>)) {
    // libtest names tests without the crate name.
    let test_path = match module.split_once("::") {
        Some((_, rest)) => format!("{rest}::{name}"),
        None => name.to_string(),
    };
    if let Ok(addr) = std::env::var(ENV_ROLE) {
        if std::env::var(ENV_CASE).as_deref() == Ok(test_path.as_str()) {
            run_child::<P>(&addr, case);
        }
        // In a child, every other test is a no-op (libtest filters by name anyway).
        return;
    }
    let Some(ctx_a) = open_or_skip::<P>() else {
        return;
    };
    match mode {
        Mode::Threads => run_threads::<P>(ctx_a, case),
        Mode::Processes => run_processes::<P>(ctx_a, &test_path, case),
        Mode::Remote => match std::env::var(ENV_REMOTE) {
            Ok(peer) => run_remote::<P>(ctx_a, &test_path, &peer, case),
            Err(_) => eprintln!(
                "skipping: {ENV_REMOTE} is not set (side B runs on another host: \
                 softroce/ci.sh runs these cases between two VMs)"
            ),
        },
    }
}

/// Reads one line from `s` within `limit` (without the newline).
fn read_line(s: &mut TcpStream, limit: Duration) -> std::io::Result<String> {
    s.set_read_timeout(Some(limit))?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        match s.read(&mut b)? {
            0 => break,
            _ if b[0] == b'\n' => break,
            _ => line.push(b[0]),
        }
    }
    Ok(String::from_utf8_lossy(&line).into_owned())
}

/// Side A of [`Mode::Remote`]: asks the peer server at `peer` to start side B of
/// `test_path`, which connects back to a listener here; at the end the peer server reports
/// side B's exit status.
fn run_remote<P: Provider>(ctx_a: P::Context, test_path: &str, peer: &str, case: fn(&mut Side<P>)) {
    let start = Instant::now();
    let mut ctl = loop {
        match TcpStream::connect(peer) {
            Ok(c) => break c,
            Err(e) => {
                // The peer server in the other host starts at the same time as we do.
                assert!(
                    start.elapsed() < Duration::from_secs(60),
                    "the peer server at {peer} does not answer: {e}"
                );
                std::thread::sleep(Duration::from_millis(250));
            }
        }
    };
    let here = ctl.local_addr().expect("local addr").ip();
    let listener = TcpListener::bind((here, 0)).expect("bind the side channel");
    let addr = listener.local_addr().expect("local addr");
    ctl.write_all(format!("run {test_path} {addr}\n").as_bytes())
        .expect("ask the peer server to start side B");
    listener
        .set_nonblocking(true)
        .expect("nonblocking listener");
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                assert!(
                    start.elapsed() < LINK_TIMEOUT,
                    "side B (on {peer}) did not connect within {LINK_TIMEOUT:?}"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    stream.set_nonblocking(false).expect("blocking stream");
    stream
        .set_read_timeout(Some(LINK_TIMEOUT))
        .expect("read timeout");
    stream.set_nodelay(true).expect("nodelay");
    let mut side = Side::<P> {
        role: Role::A,
        mode: Mode::Remote,
        ctx: ctx_a,
        link: Link::Tcp(stream),
        child: None,
        peer_ctl: Some(ctl),
    };
    let ra = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&mut side)));
    let ctl = side.peer_ctl.take();
    drop(side); // closes the side channel: a waiting B fails fast
    if let Err(p) = ra {
        std::panic::resume_unwind(p); // the peer server kills B when `ctl` closes
    }
    let Some(mut ctl) = ctl else {
        return; // the case killed side B
    };
    let st = read_line(&mut ctl, CASE_TIMEOUT).expect("the peer server reports side B's end");
    assert_eq!(st, "exit 0", "side B (on {peer}) failed");
}

/// The peer server of [`Mode::Remote`] (run in the other host as an ignored test, with
/// `CONFORMANCE_SERVE=ip:port`): for each `run TEST ADDR` request it starts this binary as side
/// B of `TEST` connecting to `ADDR`, kills it on `kill` (or when the request's connection
/// closes, or after [`CASE_TIMEOUT`]), and answers `exit CODE`. Serves until stdin closes.
pub fn serve_peers() {
    let Ok(addr) = std::env::var(ENV_SERVE) else {
        eprintln!("serve_peers: {ENV_SERVE} is not set; nothing to serve");
        return;
    };
    let listener = TcpListener::bind(&addr).expect("bind the peer server");
    eprintln!("serve_peers: listening on {addr}");
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut sink);
        let _ = tx.send(());
    });
    listener
        .set_nonblocking(true)
        .expect("nonblocking listener");
    let start = Instant::now();
    let limit = Duration::from_secs(1500);
    let mut served = 0u32;
    let failed = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
    loop {
        match rx.try_recv() {
            Ok(()) | Err(mpsc::TryRecvError::Disconnected) => break,
            Err(mpsc::TryRecvError::Empty) => {}
        }
        assert!(
            start.elapsed() < limit,
            "serve_peers: still serving after {limit:?}"
        );
        match listener.accept() {
            Ok((ctl, _)) => {
                served += 1;
                let failed = std::sync::Arc::clone(&failed);
                std::thread::spawn(move || {
                    if let Err(e) = serve_one(ctl) {
                        eprintln!("serve_peers: {e}");
                        failed.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => panic!("serve_peers: accept: {e}"),
        }
    }
    eprintln!(
        "serve_peers: served {served} cases ({} requests failed)",
        failed.load(std::sync::atomic::Ordering::Relaxed)
    );
}

fn serve_one(mut ctl: TcpStream) -> std::io::Result<()> {
    ctl.set_nonblocking(false)?;
    let req = read_line(&mut ctl, LINK_TIMEOUT)?;
    let mut w = req.split(' ');
    let (Some("run"), Some(test), Some(addr), None) = (w.next(), w.next(), w.next(), w.next())
    else {
        return Err(std::io::Error::other(format!("bad request {req:?}")));
    };
    let exe = std::env::current_exe()?;
    let child = Command::new(exe)
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(ENV_ROLE, addr)
        .env(ENV_CASE, test)
        .stdin(Stdio::null())
        .stdout(Stdio::null()) // libtest's report of the child; failures go to stderr
        .spawn()?;
    let mut guard = KillOnDrop(Some(child));
    // Poll the child and the control connection: `kill`, or the connection closing, kills it.
    ctl.set_nonblocking(true)?;
    let start = Instant::now();
    let mut buf = [0u8; 64];
    let status = loop {
        let c = guard.0.as_mut().expect("child");
        if let Some(st) = c.try_wait()? {
            break st;
        }
        let kill = match ctl.read(&mut buf) {
            Ok(0) => true,
            Ok(n) => buf[..n].starts_with(b"kill"),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(_) => true,
        };
        if kill || start.elapsed() > CASE_TIMEOUT {
            let _ = c.kill();
            break c.wait()?;
        }
        std::thread::sleep(Duration::from_millis(2));
    };
    guard.0 = None;
    eprintln!("serve_peers: {test}: side B {status}");
    ctl.set_nonblocking(false)?;
    let code = status.code().unwrap_or(128 + 9);
    let _ = ctl.write_all(format!("exit {code}\n").as_bytes());
    Ok(())
}

fn run_threads<P: Provider>(ctx_a: P::Context, case: fn(&mut Side<P>)) {
    let (tx_ab, rx_ab) = mpsc::channel();
    let (tx_ba, rx_ba) = mpsc::channel();
    let (done_tx, done_rx) = mpsc::channel();
    let b = std::thread::Builder::new()
        .name("side-b".into())
        .spawn(move || {
            let ctx = P::open(None).expect("side B opens a device");
            let mut side = Side::<P> {
                role: Role::B,
                mode: Mode::Threads,
                ctx,
                link: Link::Chan {
                    tx: tx_ba,
                    rx: rx_ab,
                },
                child: None,
                peer_ctl: None,
            };
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&mut side)));
            drop(side);
            let _ = done_tx.send(());
            if let Err(p) = r {
                std::panic::resume_unwind(p);
            }
        })
        .expect("spawn side B");
    let mut side = Side::<P> {
        role: Role::A,
        mode: Mode::Threads,
        ctx: ctx_a,
        link: Link::Chan {
            tx: tx_ab,
            rx: rx_ba,
        },
        child: None,
        peer_ctl: None,
    };
    let ra = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&mut side)));
    drop(side); // disconnects the channel: a waiting B fails fast
    let finished = done_rx.recv_timeout(CASE_TIMEOUT).is_ok();
    if let Err(p) = ra {
        std::panic::resume_unwind(p);
    }
    assert!(finished, "side B did not finish within {CASE_TIMEOUT:?}");
    if let Err(p) = b.join() {
        std::panic::resume_unwind(p);
    }
}

fn run_processes<P: Provider>(ctx_a: P::Context, test_path: &str, case: fn(&mut Side<P>)) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the side channel");
    let addr = listener.local_addr().expect("local addr").to_string();
    let exe = std::env::current_exe().expect("current_exe");
    let child = Command::new(exe)
        .args([test_path, "--exact", "--nocapture", "--test-threads=1"])
        .env(ENV_ROLE, &addr)
        .env(ENV_CASE, test_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null()) // libtest's report of the child; failures go to stderr
        .spawn()
        .expect("spawn side B process");
    let mut guard = KillOnDrop(Some(child));
    listener
        .set_nonblocking(true)
        .expect("nonblocking listener");
    let start = Instant::now();
    let stream = loop {
        match listener.accept() {
            Ok((s, _)) => break s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if let Some(st) = guard.0.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                    panic!("side B process exited before connecting: {st}");
                }
                assert!(
                    start.elapsed() < LINK_TIMEOUT,
                    "side B process did not connect within {LINK_TIMEOUT:?}"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => panic!("accept: {e}"),
        }
    };
    stream.set_nonblocking(false).expect("blocking stream");
    stream
        .set_read_timeout(Some(LINK_TIMEOUT))
        .expect("read timeout");
    stream.set_nodelay(true).expect("nodelay");
    let mut side = Side::<P> {
        role: Role::A,
        mode: Mode::Processes,
        ctx: ctx_a,
        link: Link::Tcp(stream),
        child: guard.0.take(),
        peer_ctl: None,
    };
    let ra = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| case(&mut side)));
    let killed = side.child.is_none();
    guard.0 = side.child.take();
    drop(side);
    if let Err(p) = ra {
        std::panic::resume_unwind(p); // the guard kills the child
    }
    if killed {
        return;
    }
    let start = Instant::now();
    loop {
        let c = guard.0.as_mut().expect("child");
        if let Some(st) = c.try_wait().expect("wait for side B") {
            // A child killed by the case itself is fine; otherwise it must have passed.
            assert!(st.success(), "side B process failed: {st}");
            guard.0 = None;
            return;
        }
        assert!(
            start.elapsed() < CASE_TIMEOUT,
            "side B process did not finish within {CASE_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn run_child<P: Provider>(addr: &str, case: fn(&mut Side<P>)) {
    let stream = TcpStream::connect(addr).expect("side B connects to the side channel");
    stream
        .set_read_timeout(Some(LINK_TIMEOUT))
        .expect("read timeout");
    stream.set_nodelay(true).expect("nodelay");
    let ctx = P::open(None).expect("side B opens a device");
    let mut side = Side::<P> {
        role: Role::B,
        mode: Mode::Processes,
        ctx,
        link: Link::Tcp(stream),
        child: None,
        peer_ctl: None,
    };
    case(&mut side);
}

/// Sleeps on `ch` until it reports an event or `timeout` passes; returns whether it did.
pub fn wait_channel<C: CompChannel>(ch: &C, timeout: Duration) -> bool {
    ch.wait(Some(timeout)).expect("comp channel wait")
}
