//! System (c): the raw provider's SEND/RECV ping-pong between two processes, the floor under
//! rdma-rpc. The client sends `size` bytes; the server answers every receive with a SEND of
//! the same length. No framing, no protocol: what is left is the provider's own cost.
//!
//! Setup over TCP: the client sends its QP endpoint, the server answers with its own, both
//! connect, the server posts its receives and sends one byte, `G`; then only verbs traffic
//! flows until the client closes the TCP connection.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use rpc_core::verbs::{
    Access, ConnectAttr, Context, Cq, Endpoint, Mr, Pd, PostError, Provider, ProviderKind,
    ProviderVisitor, Qp, QpCaps, RecvWr, SendFlags, SendWr, Wc, WcOpcode, WrOp,
};

use crate::client::{BenchClient, Probe};
use crate::measure::{self, LatencyRun, Plan, RateRun};

/// Receives each side keeps posted (more than the most outstanding calls).
const RECV_DEPTH: u32 = 256;
/// Send queue depth: outstanding calls plus unsignaled sends not yet reaped.
const SEND_DEPTH: u32 = 512;
/// Every this many sends one is signaled, reaping the unsignaled ones before it.
const SIGNAL_EVERY: u64 = 16;
/// Completions polled at once.
const BATCH: usize = 32;
/// A wait for a completion that lasts longer than this is an error (a hung peer).
const STALL: Duration = Duration::from_secs(10);
/// Largest inline payload asked for.
const MAX_INLINE: u32 = 256;

const _: () = assert!(RECV_DEPTH as usize >= 2 * crate::client::MAX_OUTSTANDING);
const _: () = assert!(SEND_DEPTH as u64 >= RECV_DEPTH as u64 + 2 * SIGNAL_EVERY);

/// One side's verbs objects: a QP on one CQ, a receive buffer and a send buffer.
struct Rig<P: Provider> {
    qp: P::Qp,
    cq: P::Cq,
    recv_mr: P::Mr,
    send_mr: P::Mr,
    inline: u32,
    sends: u64,
    _pd: P::Pd,
    _ctx: P::Context,
}

impl<P: Provider> Rig<P> {
    fn new(max_size: usize) -> Result<Rig<P>> {
        let ctx = P::open(None).context("raw: open the device")?;
        let pd = ctx.alloc_pd().context("raw: alloc_pd")?;
        let caps = *ctx.caps();
        let inline = caps.max_inline.min(MAX_INLINE);
        let cq = ctx
            .create_cq(SEND_DEPTH + RECV_DEPTH, None)
            .context("raw: create_cq")?;
        let qp = pd
            .create_qp(
                &cq,
                &cq,
                QpCaps {
                    max_send_wr: SEND_DEPTH,
                    max_recv_wr: RECV_DEPTH,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: inline,
                },
            )
            .context("raw: create_qp")?;
        let len = max_size.max(64);
        let recv_mr = pd
            .alloc_mr(len, Access::LOCAL_WRITE)
            .context("raw: register the receive buffer")?;
        let send_mr = pd
            .alloc_mr(len, Access::LOCAL_WRITE)
            .context("raw: register the send buffer")?;
        Ok(Rig {
            qp,
            cq,
            recv_mr,
            send_mr,
            inline,
            sends: 0,
            _pd: pd,
            _ctx: ctx,
        })
    }

    fn connect(&mut self, peer: &[u8]) -> Result<()> {
        let ep = Endpoint::from_bytes(peer).context("raw: the peer's endpoint")?;
        self.qp
            .connect(&ep, &ConnectAttr::default())
            .context("raw: connect the QP")
    }

    /// Posts `n` receives of the whole receive buffer.
    fn post_recvs(&mut self, n: usize) -> Result<()> {
        let sge = [self
            .recv_mr
            .sge(0, self.recv_mr.len() as u32)
            .ok_or_else(|| anyhow!("raw: receive buffer larger than 4 GiB"))?];
        let wrs = [RecvWr {
            wr_id: 0,
            sg_list: &sge,
        }; BATCH];
        let mut left = n;
        while left > 0 {
            let k = left.min(BATCH);
            // SAFETY: every SGE names `recv_mr`, which lives as long as the QP (both are
            // fields of `self`, and the QP is dropped first); no Rust reference into the
            // receive buffer is ever created, so the RNIC's writes race with nothing.
            unsafe { self.qp.post_recv(&wrs[..k]) }.map_err(post_err("post_recv"))?;
            left -= k;
        }
        Ok(())
    }

    /// Posts `n` SENDs of `len` bytes each from the send buffer.
    fn post_sends(&mut self, n: usize, len: usize) -> Result<()> {
        let sge = [self
            .send_mr
            .sge(0, len as u32)
            .ok_or_else(|| anyhow!("raw: message of {len} bytes exceeds the buffer"))?];
        let base = if len as u32 <= self.inline {
            SendFlags::INLINE
        } else {
            SendFlags::NONE
        };
        let mut wrs = [SendWr {
            wr_id: 0,
            op: WrOp::Send,
            sg_list: &sge,
            flags: base,
        }; BATCH];
        let mut left = n;
        while left > 0 {
            let k = left.min(BATCH);
            for wr in &mut wrs[..k] {
                self.sends += 1;
                wr.wr_id = self.sends;
                wr.flags = if self.sends.is_multiple_of(SIGNAL_EVERY) {
                    base | SendFlags::SIGNALED
                } else {
                    base
                };
            }
            // SAFETY: every SGE names `send_mr`, which lives as long as the QP; its bytes are
            // never written while sends are posted (the benchmark sends whatever it holds).
            unsafe { self.qp.post_send(&wrs[..k]) }.map_err(post_err("post_send"))?;
            left -= k;
        }
        Ok(())
    }

    /// Polls once; fails on an error completion. Returns the receives' byte lengths in
    /// `lens` (cleared first).
    fn poll(&mut self, wcs: &mut [Wc; BATCH], lens: &mut Vec<u32>) -> Result<usize> {
        lens.clear();
        let n = self.cq.poll(wcs).context("raw: poll_cq")?;
        for wc in &wcs[..n] {
            if !wc.is_ok() {
                bail!(
                    "raw: work completion {:?} failed: {} ({})",
                    wc.opcode,
                    wc.status.name(),
                    wc.status.likely_cause()
                );
            }
            if wc.opcode == WcOpcode::Recv {
                lens.push(wc.byte_len);
            }
        }
        Ok(n)
    }
}

fn post_err(verb: &'static str) -> impl Fn(PostError) -> anyhow::Error {
    move |e| anyhow!("raw: {verb}: {e}")
}

// ----- server ---------------------------------------------------------------------------------

/// Starts the raw echo server on `bind`; returns the TCP port clients connect to. Serves one
/// client at a time, on a thread that busy-polls while a client is connected.
///
/// # Errors
/// When the port cannot be bound or the provider is not compiled in.
pub fn start_server(provider: ProviderKind, bind: &str, max_size: usize) -> Result<u16> {
    let listener = TcpListener::bind(bind).with_context(|| format!("raw: bind {bind}"))?;
    let port = listener.local_addr()?.port();
    provider.visit(StartServer { listener, max_size })??;
    Ok(port)
}

struct StartServer {
    listener: TcpListener,
    max_size: usize,
}

impl ProviderVisitor for StartServer {
    type Output = Result<()>;

    fn visit<P: Provider>(self) -> Result<()> {
        let StartServer { listener, max_size } = self;
        std::thread::Builder::new()
            .name("raw-server".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let r = stream
                        .map_err(anyhow::Error::from)
                        .and_then(|s| serve_one::<P>(s, max_size));
                    if let Err(e) = r {
                        eprintln!("rpc-bench raw server: {e:#}");
                    }
                }
            })
            .context("raw: spawn the server thread")?;
        Ok(())
    }
}

fn serve_one<P: Provider>(mut stream: TcpStream, max_size: usize) -> Result<()> {
    stream.set_nodelay(true)?;
    let mut rig = Rig::<P>::new(max_size)?;
    let mut peer = [0u8; Endpoint::ENCODED_LEN];
    stream
        .read_exact(&mut peer)
        .context("raw: read the client's endpoint")?;
    stream.write_all(&rig.qp.endpoint().to_bytes())?;
    rig.connect(&peer)?;
    rig.post_recvs(RECV_DEPTH as usize)?;
    stream.write_all(b"G")?;
    // The client closing the TCP connection ends the echo loop.
    let stop = Arc::new(AtomicBool::new(false));
    let mut watch = stream.try_clone()?;
    let flag = Arc::clone(&stop);
    std::thread::spawn(move || {
        let mut b = [0u8; 1];
        let _ = watch.read(&mut b);
        flag.store(true, Ordering::Release);
    });
    let mut wcs = [Wc::default(); BATCH];
    let mut lens = Vec::with_capacity(BATCH);
    loop {
        let n = match rig.poll(&mut wcs, &mut lens) {
            Ok(n) => n,
            // A client that goes away may leave flushed completions behind.
            Err(_) if stop.load(Ordering::Acquire) => return Ok(()),
            Err(e) => return Err(e),
        };
        if n == 0 {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            std::hint::spin_loop();
            continue;
        }
        if lens.is_empty() {
            continue;
        }
        rig.post_recvs(lens.len())?;
        // Answer each receive with a SEND of its length (runs of equal lengths in one post).
        let mut i = 0;
        while i < lens.len() {
            let len = lens[i];
            let run = lens[i..].iter().take_while(|&&l| l == len).count();
            rig.post_sends(run, len as usize)?;
            i += run;
        }
    }
}

// ----- client ---------------------------------------------------------------------------------

/// Connects a raw client to the server at `addr`.
///
/// # Errors
/// When the server cannot be reached or the QPs cannot be connected.
pub fn connect(
    provider: ProviderKind,
    addr: std::net::SocketAddr,
    max_size: usize,
) -> Result<Box<dyn BenchClient>> {
    provider.visit(Connect { addr, max_size })?
}

struct Connect {
    addr: std::net::SocketAddr,
    max_size: usize,
}

impl ProviderVisitor for Connect {
    type Output = Result<Box<dyn BenchClient>>;

    fn visit<P: Provider>(self) -> Result<Box<dyn BenchClient>> {
        let mut stream = TcpStream::connect_timeout(&self.addr, Duration::from_secs(10))
            .with_context(|| format!("raw: connect to {}", self.addr))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut rig = Rig::<P>::new(self.max_size)?;
        stream.write_all(&rig.qp.endpoint().to_bytes())?;
        let mut peer = [0u8; Endpoint::ENCODED_LEN];
        stream
            .read_exact(&mut peer)
            .context("raw: read the server's endpoint")?;
        rig.connect(&peer)?;
        rig.post_recvs(RECV_DEPTH as usize)?;
        let mut go = [0u8; 1];
        stream
            .read_exact(&mut go)
            .context("raw: wait for the server")?;
        if go != *b"G" {
            bail!("raw: unexpected byte from the server");
        }
        Ok(Box::new(RawClient::<P> {
            rig,
            _stream: stream,
            wcs: [Wc::default(); BATCH],
            lens: Vec::with_capacity(BATCH),
        }))
    }
}

struct RawClient<P: Provider> {
    rig: Rig<P>,
    _stream: TcpStream,
    wcs: [Wc; BATCH],
    lens: Vec<u32>,
}

impl<P: Provider> RawClient<P> {
    /// Waits for at least one receive; returns how many arrived.
    fn wait_recvs(&mut self) -> Result<usize> {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            self.rig.poll(&mut self.wcs, &mut self.lens)?;
            if !self.lens.is_empty() {
                let n = self.lens.len();
                self.rig.post_recvs(n)?;
                return Ok(n);
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) && start.elapsed() > STALL {
                bail!("raw: no answer from the server for {STALL:?}");
            }
            std::hint::spin_loop();
        }
    }

    /// Keeps `k` calls outstanding until `stop` says so, then drains; returns the calls
    /// completed before the stop and when the stop came.
    fn windowed(
        &mut self,
        size: usize,
        k: usize,
        stop: impl Fn(Instant, u64) -> bool,
    ) -> Result<(u64, Duration)> {
        let start = Instant::now();
        self.rig.post_sends(k, size)?;
        let mut in_flight = k;
        let mut done = 0u64;
        let mut stopped: Option<Duration> = None;
        while in_flight > 0 {
            let n = self.wait_recvs()?;
            in_flight -= n;
            if stopped.is_none() {
                done += n as u64;
                if stop(start, done) {
                    stopped = Some(start.elapsed());
                } else {
                    self.rig.post_sends(n, size)?;
                    in_flight += n;
                }
            }
        }
        Ok((done, stopped.unwrap_or_else(|| start.elapsed())))
    }
}

impl<P: Provider> BenchClient for RawClient<P> {
    fn latency(&mut self, size: usize, plan: &Plan, probe: &mut dyn Probe) -> Result<LatencyRun> {
        self.windowed(size, 1, |t, n| plan.warm(t, n))?;
        let before = probe.snapshot()?;
        let mut hist = measure::histogram();
        let start = Instant::now();
        let mut calls = 0u64;
        while !plan.done(start, plan.latency, calls) {
            let t0 = Instant::now();
            self.rig.post_sends(1, size)?;
            self.wait_recvs()?;
            measure::record(&mut hist, t0.elapsed());
            calls += 1;
        }
        let wall = start.elapsed();
        let cpu = probe.snapshot()?.since(before);
        Ok(LatencyRun {
            hist,
            calls,
            wall,
            cpu,
        })
    }

    fn rate(
        &mut self,
        size: usize,
        outstanding: usize,
        plan: &Plan,
        probe: &mut dyn Probe,
    ) -> Result<RateRun> {
        self.windowed(size, outstanding, |t, n| plan.warm(t, n))?;
        let before = probe.snapshot()?;
        let (calls, wall) = self.windowed(size, outstanding, |t, n| plan.done(t, plan.rate, n))?;
        let cpu = probe.snapshot()?.since(before);
        Ok(RateRun { calls, wall, cpu })
    }
}
