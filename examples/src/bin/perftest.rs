//! perftest-style benchmarks of the verbs layer, like `ib_send_lat` / `ib_write_bw`:
//! `send_lat`, `write_lat`, `read_lat`, `send_bw`, `write_bw`, `read_bw` between two processes,
//! with a TCP side channel for endpoints and rkeys.
//!
//! ```text
//! perftest write_bw --server                       # on one side
//! perftest write_bw --connect HOST:18515           # on the other
//! perftest send_lat --size 8                       # both sides: spawns the server itself
//! perftest write_bw --all --json out.json
//! ```
//!
//! Output follows perftest's tables. Latency tests report t_min, t_max, t_typical (median),
//! t_avg, t_stdev and the 99% / 99.9% percentiles in microseconds; `send_lat` and `write_lat`
//! report half the round trip, as perftest does, `read_lat` the whole READ. Bandwidth tests
//! report BW peak and average in Gb/s and the message rate in Mpps; `write_bw` also measures
//! single-thread memcpy bandwidth of the same size in the same run and, on the soft provider,
//! the ratio of bytes the soft RNIC copied to bytes transferred.
//!
//! Both processes busy-poll (pinned to different CPUs when there are two), and both are
//! bounded in time (`--timeout`).
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use clap::{Parser, ValueEnum};
use rpc_core::verbs::soft::{CounterSnapshot, Soft};
use rpc_core::verbs::{
    Access, ConnectAttr, Context, Cq, Endpoint, Mr, Pd, Provider, ProviderKind, ProviderVisitor,
    Qp, QpCaps, RecvWr, RemoteMr, SendFlags, SendWr, Sge, Wc, WcStatus, WrOp,
};
use serde::Serialize;

/// The tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
enum Test {
    SendLat,
    WriteLat,
    ReadLat,
    SendBw,
    WriteBw,
    ReadBw,
}

impl Test {
    fn is_lat(self) -> bool {
        matches!(self, Test::SendLat | Test::WriteLat | Test::ReadLat)
    }

    fn name(self) -> &'static str {
        match self {
            Test::SendLat => "send_lat",
            Test::WriteLat => "write_lat",
            Test::ReadLat => "read_lat",
            Test::SendBw => "send_bw",
            Test::WriteBw => "write_bw",
            Test::ReadBw => "read_bw",
        }
    }

    fn title(self) -> &'static str {
        match self {
            Test::SendLat => "Send Latency Test",
            Test::WriteLat => "RDMA_Write Latency Test",
            Test::ReadLat => "RDMA_Read Latency Test",
            Test::SendBw => "Send BW Test",
            Test::WriteBw => "RDMA_Write BW Test",
            Test::ReadBw => "RDMA_Read BW Test",
        }
    }

    fn from_name(s: &str) -> Option<Test> {
        Test::value_variants()
            .iter()
            .copied()
            .find(|t| t.name() == s)
    }
}

/// perftest-style verbs benchmarks between two processes.
#[derive(Parser, Debug, Clone)]
#[command(name = "perftest")]
struct Args {
    /// Which test.
    #[arg(value_enum)]
    test: Test,
    /// Serve: wait for a client on --listen.
    #[arg(long)]
    server: bool,
    /// Run as the client of a server at HOST:PORT.
    #[arg(long, value_name = "HOST:PORT")]
    connect: Option<String>,
    /// Address the server listens on.
    #[arg(long, default_value = "0.0.0.0:18515")]
    listen: String,
    /// Message size in bytes (default: 2 for latency tests, 65536 for bandwidth tests).
    #[arg(long)]
    size: Option<usize>,
    /// Iterations per size (default: 1000 for latency, 5000 for bandwidth; with --all, large
    /// sizes run fewer so that each size moves at most 4 GiB).
    #[arg(long)]
    iters: Option<usize>,
    /// Run every size from 2 bytes to 8 MiB.
    #[arg(long)]
    all: bool,
    /// Also write the figures as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Provider: soft or ib.
    #[arg(long, default_value = "soft")]
    provider: String,
    /// Outstanding work requests of bandwidth tests.
    #[arg(long, default_value_t = 128)]
    tx_depth: u32,
    /// Pin this process to a CPU.
    #[arg(long)]
    cpu: Option<usize>,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 120)]
    timeout: u64,
    /// (internal) print the listening port on stdout, for the spawning client.
    #[arg(long, hide = true)]
    print_port: bool,
}

/// One row of a latency table.
#[derive(Debug, Clone, Serialize)]
struct LatRow {
    bytes: usize,
    iterations: usize,
    t_min_us: f64,
    t_max_us: f64,
    t_typical_us: f64,
    t_avg_us: f64,
    t_stdev_us: f64,
    p99_us: f64,
    p999_us: f64,
}

/// One row of a bandwidth table.
#[derive(Debug, Clone, Serialize)]
struct BwRow {
    bytes: usize,
    iterations: usize,
    bw_peak_gbps: f64,
    bw_avg_gbps: f64,
    msg_rate_mpps: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    memcpy_gbps: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    copy_ratio: Option<f64>,
}

#[derive(Debug, Serialize)]
struct Report {
    test: Test,
    provider: String,
    device: String,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    latency: Vec<LatRow>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    bandwidth: Vec<BwRow>,
}

const RX_DEPTH: u32 = 512;
const LINE: &str =
    "---------------------------------------------------------------------------------------";

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(cpu) = args.cpu {
        pin_to(cpu);
    }
    if args.server {
        let listener = TcpListener::bind(&args.listen)
            .with_context(|| format!("bind the side channel on {}", args.listen))?;
        if args.print_port {
            println!("PORT {}", listener.local_addr()?.port());
            std::io::stdout().flush()?;
        } else {
            eprintln!(
                "perftest {}: waiting for a client on {}",
                args.test.name(),
                listener.local_addr()?
            );
        }
        let (stream, _) = listener.accept().context("accept the client")?;
        return run_role(&args, stream, false);
    }
    if let Some(addr) = &args.connect {
        let stream = TcpStream::connect(addr).with_context(|| format!("connect to {addr}"))?;
        return run_role(&args, stream, true);
    }
    run_both(&args)
}

/// No --server and no --connect: spawn the server as a child process and be the client.
fn run_both(args: &Args) -> Result<()> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg(args.test.name())
        .args(["--server", "--listen", "127.0.0.1:0", "--print-port"])
        .args(["--provider", &args.provider])
        .args(["--tx-depth", &args.tx_depth.to_string()])
        .args(["--timeout", &args.timeout.to_string()]);
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    if ncpu >= 2 {
        cmd.args(["--cpu", "1"]);
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .context("spawn the server process")?;
    let out = child.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
    let mut line = String::new();
    BufReader::new(out).read_line(&mut line)?;
    let port: u16 = line
        .trim()
        .strip_prefix("PORT ")
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| anyhow!("server did not report its port: {line:?}"))?;
    if ncpu >= 2 && args.cpu.is_none() {
        pin_to(0);
    }
    let stream = TcpStream::connect(("127.0.0.1", port))?;
    let r = run_role(args, stream, true);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match child.try_wait()? {
            Some(st) if st.success() => break,
            Some(st) => bail!("server process failed: {st}"),
            None if Instant::now() > deadline => {
                let _ = child.kill();
                bail!("server process did not exit");
            }
            None => std::thread::sleep(Duration::from_millis(5)),
        }
    }
    r
}

fn pin_to(cpu: usize) {
    // SAFETY: `cpu_set_t` is plain data; CPU_ZERO/CPU_SET write inside it;
    // sched_setaffinity reads it. Failure only means no pinning.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_ZERO(&mut set);
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn run_role(args: &Args, stream: TcpStream, client: bool) -> Result<()> {
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(args.timeout)))?;
    let kind: ProviderKind = args.provider.parse()?;
    match kind {
        ProviderKind::Soft => run::<Soft>(
            args,
            stream,
            client,
            &|c: &rpc_core::verbs::soft::SoftContext| Some(c.counters()),
        ),
        other => other.visit(Visit {
            args: args.clone(),
            stream,
            client,
        })?,
    }
}

struct Visit {
    args: Args,
    stream: TcpStream,
    client: bool,
}

impl ProviderVisitor for Visit {
    type Output = Result<()>;
    fn visit<P: Provider>(self) -> Result<()> {
        run::<P>(&self.args, self.stream, self.client, &|_| None)
    }
}

/// The side channel: length-prefixed messages.
struct Chan(TcpStream);

impl Chan {
    fn send(&mut self, b: &[u8]) -> Result<()> {
        self.0.write_all(&(b.len() as u32).to_le_bytes())?;
        self.0.write_all(b)?;
        Ok(())
    }

    fn recv(&mut self) -> Result<Vec<u8>> {
        let mut l = [0u8; 4];
        self.0.read_exact(&mut l).context("side channel")?;
        let mut b = vec![0u8; u32::from_le_bytes(l) as usize];
        self.0.read_exact(&mut b).context("side channel")?;
        Ok(b)
    }

    fn barrier(&mut self) -> Result<()> {
        self.send(b"sync")?;
        let m = self.recv()?;
        if m != b"sync" {
            bail!("side channel out of step");
        }
        Ok(())
    }
}

/// Everything one side set up.
struct Rig<P: Provider> {
    ctx: P::Context,
    _pd: P::Pd,
    cq: P::Cq,
    qp: P::Qp,
    mr: P::Mr,
    remote: RemoteMr,
    inline: u32,
    deadline: Instant,
    /// Receives posted and not yet completed (they span the whole buffer, so receives left
    /// over from one size serve the next).
    recvs: usize,
}

fn sizes(args: &Args) -> Vec<usize> {
    if args.all {
        (1..=23).map(|k| 1usize << k).collect()
    } else {
        vec![
            args.size
                .unwrap_or(if args.test.is_lat() { 2 } else { 65536 }),
        ]
    }
}

fn iters_for(args: &Args, size: usize) -> usize {
    let base = args
        .iters
        .unwrap_or(if args.test.is_lat() { 1000 } else { 5000 });
    if args.all {
        base.min(((4usize << 30) / size).max(100))
    } else {
        base
    }
}

fn run<P: Provider>(
    args: &Args,
    stream: TcpStream,
    client: bool,
    counters: &dyn Fn(&P::Context) -> Option<CounterSnapshot>,
) -> Result<()> {
    let mut ch = Chan(stream);
    // The client decides the parameters.
    let (test, sizes, iters_arg, all) = if client {
        let sz = sizes(args);
        let msg = format!(
            "{} {} {} {}",
            args.test.name(),
            sz.iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
                .join(","),
            args.iters.unwrap_or(0),
            u8::from(args.all)
        );
        ch.send(msg.as_bytes())?;
        (args.test, sz, args.iters, args.all)
    } else {
        let m = String::from_utf8(ch.recv()?)?;
        let f: Vec<&str> = m.split(' ').collect();
        if f.len() != 4 {
            bail!("bad parameters from the client: {m:?}");
        }
        let test = Test::from_name(f[0]).ok_or_else(|| anyhow!("unknown test {}", f[0]))?;
        let sz = f[1]
            .split(',')
            .map(str::parse)
            .collect::<std::result::Result<Vec<usize>, _>>()?;
        let it: usize = f[2].parse()?;
        (test, sz, (it != 0).then_some(it), f[3] == "1")
    };
    let eff = Args {
        test,
        iters: iters_arg,
        all,
        ..args.clone()
    };
    // write_lat uses two message buffers (what arrives, what leaves).
    let max = 2 * sizes.iter().copied().max().unwrap_or(2).max(64);
    let mut rig = setup::<P>(&eff, &mut ch, max)?;
    let device = rig.ctx.info().name.clone();
    if client {
        print_header(test, P::NAME, &device, &eff);
    }
    let mut report = Report {
        test,
        provider: P::NAME.to_string(),
        device,
        latency: Vec::new(),
        bandwidth: Vec::new(),
    };
    for &size in &sizes {
        let iters = iters_for(&eff, size);
        ch.barrier()?;
        match test {
            Test::SendLat | Test::WriteLat | Test::ReadLat => {
                let samples = match test {
                    Test::SendLat => send_lat(&mut rig, client, size, iters)?,
                    Test::WriteLat => write_lat(&mut rig, client, size, iters)?,
                    _ => read_lat(&mut rig, client, size, iters, &mut ch)?,
                };
                if client {
                    let row = lat_row(size, samples);
                    print_lat(&row);
                    report.latency.push(row);
                }
            }
            Test::SendBw | Test::WriteBw | Test::ReadBw => {
                rdma_warmup(&mut rig, client, test, size)?;
                let before = counters(&rig.ctx);
                let stamps = match test {
                    Test::SendBw => send_bw(&mut rig, client, size, iters, eff.tx_depth)?,
                    _ => rdma_bw(&mut rig, client, test, size, iters, eff.tx_depth)?,
                };
                // The server learns the end from the client.
                if client {
                    ch.send(b"done")?;
                } else {
                    ch.recv()?;
                }
                if client {
                    let after = counters(&rig.ctx);
                    let mut row = bw_row(size, iters, &stamps, eff.tx_depth as usize);
                    if test == Test::WriteBw {
                        row.memcpy_gbps = Some(memcpy_gbps(size, iters));
                        if let (Some(b), Some(a)) = (before, after) {
                            let moved = (size * iters) as f64;
                            row.copy_ratio = Some((a.bytes_copied - b.bytes_copied) as f64 / moved);
                        }
                    }
                    print_bw(&row);
                    report.bandwidth.push(row);
                }
            }
        }
    }
    ch.barrier()?;
    if client {
        println!("{LINE}");
        if let Some(path) = &args.json {
            std::fs::write(path, serde_json::to_string_pretty(&report)?)
                .with_context(|| format!("write {}", path.display()))?;
        }
    }
    Ok(())
}

fn setup<P: Provider>(args: &Args, ch: &mut Chan, max: usize) -> Result<Rig<P>> {
    let ctx = P::open(None)?;
    let caps = *ctx.caps();
    let pd = ctx.alloc_pd()?;
    let tx = args.tx_depth.clamp(1, caps.max_qp_wr);
    let rx = RX_DEPTH.min(caps.max_qp_wr);
    let cq = ctx.create_cq(tx + rx, None)?;
    let inline = caps.max_inline.min(256);
    let mut qp = pd.create_qp(
        &cq,
        &cq,
        QpCaps {
            max_send_wr: tx,
            max_recv_wr: rx,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: inline,
        },
    )?;
    let mr = pd.alloc_mr(max, Access::ALL)?;
    let attr = ConnectAttr {
        min_rnr_timer: 1, // 10 µs: keep send_bw moving when the server lags
        ..ConnectAttr::default()
    };
    qp.modify_to_init(attr.access)?;
    let mut mine = qp.endpoint().to_bytes().to_vec();
    mine.extend_from_slice(&mr.remote().to_bytes());
    ch.send(&mine)?;
    let theirs = ch.recv()?;
    let ep = Endpoint::from_bytes(&theirs)?;
    let remote = RemoteMr::from_bytes(&theirs[Endpoint::ENCODED_LEN..])
        .ok_or_else(|| anyhow!("bad remote MR from the peer"))?;
    qp.connect(&ep, &attr)?;
    ch.barrier()?;
    Ok(Rig {
        ctx,
        _pd: pd,
        cq,
        qp,
        mr,
        remote,
        inline,
        deadline: Instant::now() + Duration::from_secs(args.timeout),
        recvs: 0,
    })
}

impl<P: Provider> Rig<P> {
    fn check_deadline(&self) -> Result<()> {
        if Instant::now() > self.deadline {
            bail!("timed out (--timeout)");
        }
        Ok(())
    }

    fn post_send_one(&mut self, wr: SendWr<'_>) -> Result<()> {
        // SAFETY: every SGE names `self.mr`, which lives as long as the QP; the benchmark
        // never reads or writes a buffer that a posted request targets in a way that matters
        // for memory safety (payload bytes only).
        unsafe { self.qp.post_send(std::slice::from_ref(&wr)) }
            .map_err(|e| anyhow!("post_send: {e}"))
    }

    /// Posts receives until `target` are outstanding.
    fn top_up_recvs(&mut self, target: usize) -> Result<()> {
        let n = target.saturating_sub(self.recvs);
        let len = u32::try_from(self.mr.len()).unwrap_or(u32::MAX);
        let sge = [self.mr.sge(0, len).ok_or_else(|| anyhow!("size"))?];
        let wrs = [RecvWr {
            wr_id: 0,
            sg_list: &sge,
        }; 32];
        let mut left = n;
        while left > 0 {
            let k = left.min(wrs.len());
            // SAFETY: as in `post_send_one`.
            unsafe { self.qp.post_recv(&wrs[..k]) }.map_err(|e| anyhow!("post_recv: {e}"))?;
            left -= k;
            self.recvs += k;
        }
        Ok(())
    }

    /// Polls until at least one completion; checks every status.
    fn poll_some(&mut self, wcs: &mut [Wc]) -> Result<usize> {
        let mut spins = 0u32;
        loop {
            let n = self.cq.poll(wcs)?;
            if n > 0 {
                for wc in &wcs[..n] {
                    if wc.status != WcStatus::Success {
                        bail!("work completion error: {:?}", wc);
                    }
                }
                return Ok(n);
            }
            spins += 1;
            if spins & 0xffff == 0 {
                self.check_deadline()?;
            }
        }
    }
}

/// SEND ping-pong; returns half round trips in nanoseconds (client).
fn send_lat<P: Provider>(
    rig: &mut Rig<P>,
    client: bool,
    size: usize,
    iters: usize,
) -> Result<Vec<u64>> {
    const PRE: usize = 16;
    rig.top_up_recvs(PRE)?;
    let flags_base = if size as u32 <= rig.inline {
        SendFlags::INLINE
    } else {
        SendFlags::NONE
    };
    let sge = [rig.mr.sge(0, size as u32).ok_or_else(|| anyhow!("size"))?];
    let mut wcs = [Wc::default(); 16];
    let mut samples = Vec::with_capacity(iters);
    let warm = iters / 10 + 10;
    let total = iters + warm;
    // Sends are signaled every 16th (queue slots), receives always complete.
    let mut pending_recvs = 0usize;
    let send = |rig: &mut Rig<P>, i: usize| -> Result<()> {
        let flags = if i % 16 == 15 {
            flags_base | SendFlags::SIGNALED
        } else {
            flags_base
        };
        rig.post_send_one(SendWr {
            wr_id: i as u64,
            op: WrOp::Send,
            sg_list: &sge,
            flags,
        })
    };
    let wait_recv = |rig: &mut Rig<P>, wcs: &mut [Wc], pending: &mut usize| -> Result<()> {
        while *pending == 0 {
            let n = rig.poll_some(wcs)?;
            let r = wcs[..n]
                .iter()
                .filter(|w| w.opcode == rpc_core::verbs::WcOpcode::Recv)
                .count();
            *pending += r;
            rig.recvs -= r;
        }
        *pending -= 1;
        Ok(())
    };
    for i in 0..total {
        if client {
            let t0 = Instant::now();
            send(rig, i)?;
            wait_recv(rig, &mut wcs, &mut pending_recvs)?;
            let dt = t0.elapsed().as_nanos() as u64;
            rig.top_up_recvs(PRE)?;
            if i >= warm {
                samples.push(dt / 2);
            }
        } else {
            wait_recv(rig, &mut wcs, &mut pending_recvs)?;
            rig.top_up_recvs(PRE)?;
            send(rig, i)?;
        }
    }
    Ok(samples)
}

/// WRITE ping-pong: each side writes the iteration number into the other's buffer and polls
/// its own buffer's last byte. Half round trips in nanoseconds (client).
fn write_lat<P: Provider>(
    rig: &mut Rig<P>,
    client: bool,
    size: usize,
    iters: usize,
) -> Result<Vec<u64>> {
    let flags_base = if size as u32 <= rig.inline {
        SendFlags::INLINE
    } else {
        SendFlags::NONE
    };
    let last = size - 1;
    let out_off = size; // what we send lives after what we receive
    if 2 * size > rig.mr.len() {
        bail!("buffer too small");
    }
    let sge = [rig
        .mr
        .sge(out_off, size as u32)
        .ok_or_else(|| anyhow!("size"))?];
    let in_ptr = rig.mr.as_ptr();
    let out_ptr = rig.mr.as_ptr();
    let seen = |v: u8| {
        // SAFETY: `last < size <= mr.len()` (checked above); read volatile because the
        // peer's WRITEs land in this byte concurrently.
        unsafe { std::ptr::read_volatile(in_ptr.add(last)) == v }
    };
    let set_out = |v: u8| {
        // SAFETY: `out_off + last < 2 * size <= mr.len()` (checked above).
        unsafe { std::ptr::write_volatile(out_ptr.add(out_off + last), v) }
    };
    let mut wcs = [Wc::default(); 16];
    let warm = iters / 10 + 10;
    let total = iters + warm;
    let mut samples = Vec::with_capacity(iters);
    let remote = rig.remote;
    let mut spins = 0u64;
    let mut wait = |rig: &mut Rig<P>, v: u8| -> Result<()> {
        while !seen(v) {
            spins += 1;
            if spins & 0xffff == 0 {
                rig.check_deadline()?;
            }
            std::hint::spin_loop();
        }
        Ok(())
    };
    for i in 0..total {
        let v = (i % 251) as u8 + 1;
        let mut write = |rig: &mut Rig<P>| -> Result<()> {
            set_out(v);
            let flags = if i % 16 == 15 {
                flags_base | SendFlags::SIGNALED
            } else {
                flags_base
            };
            rig.post_send_one(SendWr {
                wr_id: i as u64,
                op: WrOp::Write {
                    remote_addr: remote.addr,
                    rkey: remote.rkey,
                },
                sg_list: &sge,
                flags,
            })?;
            if i % 16 == 15 {
                rig.poll_some(&mut wcs)?;
            }
            Ok(())
        };
        if client {
            let t0 = Instant::now();
            write(rig)?;
            wait(rig, v)?;
            let dt = t0.elapsed().as_nanos() as u64;
            if i >= warm {
                samples.push(dt / 2);
            }
        } else {
            wait(rig, v)?;
            write(rig)?;
        }
    }
    Ok(samples)
}

/// READ latency (client only); the server waits on the side channel.
fn read_lat<P: Provider>(
    rig: &mut Rig<P>,
    client: bool,
    size: usize,
    iters: usize,
    ch: &mut Chan,
) -> Result<Vec<u64>> {
    if !client {
        ch.recv()?;
        return Ok(Vec::new());
    }
    let sge = [rig.mr.sge(0, size as u32).ok_or_else(|| anyhow!("size"))?];
    let mut wcs = [Wc::default(); 4];
    let warm = iters / 10 + 10;
    let mut samples = Vec::with_capacity(iters);
    let remote = rig.remote;
    for i in 0..iters + warm {
        let t0 = Instant::now();
        rig.post_send_one(SendWr {
            wr_id: i as u64,
            op: WrOp::Read {
                remote_addr: remote.addr,
                rkey: remote.rkey,
            },
            sg_list: &sge,
            flags: SendFlags::SIGNALED,
        })?;
        rig.poll_some(&mut wcs)?;
        let dt = t0.elapsed().as_nanos() as u64;
        if i >= warm {
            samples.push(dt);
        }
    }
    ch.send(b"done")?;
    Ok(samples)
}

/// Posts `iters` WRITEs or READs with up to `depth` outstanding; returns completion stamps.
fn rdma_bw<P: Provider>(
    rig: &mut Rig<P>,
    client: bool,
    test: Test,
    size: usize,
    iters: usize,
    depth: u32,
) -> Result<Stamps> {
    if !client {
        return Ok(Vec::new());
    }
    let remote = rig.remote;
    let op = if test == Test::WriteBw {
        WrOp::Write {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        }
    } else {
        WrOp::Read {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        }
    };
    let sge = [rig.mr.sge(0, size as u32).ok_or_else(|| anyhow!("size"))?];
    stream_sends(rig, op, &sge, iters, depth)
}

/// One-sided tests: a few requests before measuring (maps the peer's region, faults pages
/// in), outside the counter window.
fn rdma_warmup<P: Provider>(rig: &mut Rig<P>, client: bool, test: Test, size: usize) -> Result<()> {
    if !client || !matches!(test, Test::WriteBw | Test::ReadBw) {
        return Ok(());
    }
    let remote = rig.remote;
    let op = if test == Test::WriteBw {
        WrOp::Write {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        }
    } else {
        WrOp::Read {
            remote_addr: remote.addr,
            rkey: remote.rkey,
        }
    };
    let sge = [rig.mr.sge(0, size as u32).ok_or_else(|| anyhow!("size"))?];
    for i in 0..8u64 {
        rig.post_send_one(SendWr {
            wr_id: u64::MAX - i,
            op,
            sg_list: &sge,
            flags: SendFlags::SIGNALED,
        })?;
        let mut w = [Wc::default(); 1];
        rig.poll_some(&mut w)?;
    }
    Ok(())
}

/// When (ns since the start) how many requests had completed: one entry per poll that
/// returned completions.
type Stamps = Vec<(u64, usize)>;

/// Posts `iters` requests with up to `depth` outstanding, signaling every `depth / 4`-th;
/// returns the completion stamps.
fn stream_sends<P: Provider>(
    rig: &mut Rig<P>,
    op: WrOp,
    sge: &[Sge; 1],
    iters: usize,
    depth: u32,
) -> Result<Stamps> {
    let depth = depth as usize;
    let every = (depth / 4).max(1);
    let mut stamps = Vec::with_capacity(iters / every + 2);
    let mut wcs = [Wc::default(); 32];
    let (mut posted, mut done) = (0usize, 0usize);
    let start = Instant::now();
    while done < iters {
        while posted < iters && posted - done < depth {
            let k = (iters - posted).min(depth - (posted - done)).min(32);
            let mut wrs = [SendWr {
                wr_id: 0,
                op,
                sg_list: sge,
                flags: SendFlags::NONE,
            }; 32];
            for (j, wr) in wrs[..k].iter_mut().enumerate() {
                let id = posted + j;
                wr.wr_id = id as u64;
                if id % every == every - 1 || id == iters - 1 {
                    wr.flags = SendFlags::SIGNALED;
                }
            }
            // SAFETY: as in `Rig::post_send_one`.
            match unsafe { rig.qp.post_send(&wrs[..k]) } {
                Ok(()) => posted += k,
                Err(e) if e.error.is_queue_full() => {
                    posted += e.posted;
                    break;
                }
                Err(e) => bail!("post_send: {e}"),
            }
        }
        let n = rig.poll_some(&mut wcs)?;
        let now = start.elapsed().as_nanos() as u64;
        for wc in &wcs[..n] {
            let id = wc.wr_id as usize;
            if id < iters {
                done = done.max(id + 1);
            }
        }
        stamps.push((now, done));
    }
    Ok(stamps)
}

/// SEND bandwidth: the client streams, the server keeps receives posted.
fn send_bw<P: Provider>(
    rig: &mut Rig<P>,
    client: bool,
    size: usize,
    iters: usize,
    depth: u32,
) -> Result<Stamps> {
    let sge = [rig.mr.sge(0, size as u32).ok_or_else(|| anyhow!("size"))?];
    if client {
        return stream_sends(rig, WrOp::Send, &sge, iters, depth);
    }
    rig.top_up_recvs(RX_DEPTH as usize)?;
    let mut got = 0usize;
    let mut wcs = [Wc::default(); 32];
    while got < iters {
        let n = rig.poll_some(&mut wcs)?;
        got += n;
        rig.recvs -= n;
        rig.top_up_recvs(RX_DEPTH as usize)?;
    }
    Ok(Vec::new())
}

/// Single-thread memcpy bandwidth between two buffers of `size` bytes, over at least `iters`
/// copies and at least 50 ms.
fn memcpy_gbps(size: usize, iters: usize) -> f64 {
    let src = vec![1u8; size];
    let mut dst = vec![0u8; size];
    for _ in 0..4 {
        dst.copy_from_slice(&src);
    }
    let t0 = Instant::now();
    let mut reps = 0usize;
    while reps < iters.max(8) || t0.elapsed() < Duration::from_millis(50) {
        for _ in 0..8 {
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
        }
        reps += 8;
    }
    let ns = t0.elapsed().as_nanos().max(1) as f64;
    (size * reps) as f64 * 8.0 / ns
}

fn lat_row(bytes: usize, mut s: Vec<u64>) -> LatRow {
    s.sort_unstable();
    let n = s.len().max(1);
    let us = |ns: u64| ns as f64 / 1000.0;
    let avg = s.iter().sum::<u64>() as f64 / n as f64;
    let var = s.iter().map(|&x| (x as f64 - avg).powi(2)).sum::<f64>() / n as f64;
    let pct = |p: f64| s[((p * n as f64).ceil() as usize).clamp(1, n) - 1];
    LatRow {
        bytes,
        iterations: s.len(),
        t_min_us: us(s[0]),
        t_max_us: us(s[n - 1]),
        t_typical_us: us(s[n / 2]),
        t_avg_us: avg / 1000.0,
        t_stdev_us: var.sqrt() / 1000.0,
        p99_us: us(pct(0.99)),
        p999_us: us(pct(0.999)),
    }
}

fn bw_row(bytes: usize, iters: usize, stamps: &[(u64, usize)], depth: usize) -> BwRow {
    let total_ns = stamps.last().map_or(1, |s| s.0).max(1) as f64;
    let avg = (bytes * iters) as f64 * 8.0 / total_ns;
    // Peak: the best rate between two polls at least `depth` completions apart (what was
    // done at the first poll is not counted in the interval).
    let w = depth.clamp(1, iters.max(1));
    let mut peak = avg;
    let mut j = 0;
    for a in stamps {
        while j < stamps.len() && stamps[j].1 < a.1 + w {
            j += 1;
        }
        let Some(b) = stamps.get(j) else { break };
        let dt = b.0.saturating_sub(a.0);
        if dt > 0 {
            peak = peak.max(((b.1 - a.1) * bytes) as f64 * 8.0 / dt as f64);
        }
    }
    BwRow {
        bytes,
        iterations: iters,
        bw_peak_gbps: peak,
        bw_avg_gbps: avg,
        msg_rate_mpps: iters as f64 / (total_ns / 1000.0),
        memcpy_gbps: None,
        copy_ratio: None,
    }
}

fn print_header(test: Test, provider: &str, device: &str, args: &Args) {
    println!("{LINE}");
    println!("                    {}", test.title());
    println!(" Provider        : {provider:<14} Device         : {device}");
    println!(" Connection type : RC             Using SRQ      : OFF");
    if test.is_lat() {
        println!(" TX depth        : 1              Mtu            : 4096[B]");
    } else {
        println!(
            " TX depth        : {:<14} CQ Moderation  : {}",
            args.tx_depth,
            (args.tx_depth / 4).max(1)
        );
    }
    println!("{LINE}");
    if test.is_lat() {
        println!(
            " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    \
             t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
        );
    } else {
        println!(
            " #bytes     #iterations    BW peak[Gb/sec]    BW average[Gb/sec]   MsgRate[Mpps]"
        );
    }
}

fn print_lat(r: &LatRow) {
    println!(
        " {:<6} {:<11} {:<14.2} {:<12.2} {:<16.2} {:<14.2} {:<15.2} {:<22.2} {:.2}",
        r.bytes,
        r.iterations,
        r.t_min_us,
        r.t_max_us,
        r.t_typical_us,
        r.t_avg_us,
        r.t_stdev_us,
        r.p99_us,
        r.p999_us
    );
}

fn print_bw(r: &BwRow) {
    print!(
        " {:<10} {:<14} {:<18.2} {:<20.2} {:.6}",
        r.bytes, r.iterations, r.bw_peak_gbps, r.bw_avg_gbps, r.msg_rate_mpps
    );
    if let Some(m) = r.memcpy_gbps {
        print!(
            "   | memcpy {:.2} Gb/s ({:.0}%)",
            m,
            100.0 * r.bw_avg_gbps / m
        );
    }
    if let Some(c) = r.copy_ratio {
        print!(" copy ratio {c:.3}");
    }
    println!();
}
