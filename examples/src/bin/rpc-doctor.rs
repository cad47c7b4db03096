//! `rpc-doctor`: is this machine ready for rdma-rpc? In the spirit of `ibv_devinfo` +
//! `show_gids` + a checklist: providers, RDMA devices and ports (state, link layer, MTU,
//! firmware), GID tables with the RoCE version and the GID the ib provider would choose, the
//! locked-memory limit, GPU memory support (nvidia-peermem), then a loopback ping-pong on the
//! chosen provider and device. Every problem is printed with its fix.
//!
//! Exit status: 0 when nothing blocks the chosen provider, 1 otherwise.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use rpc_core::verbs::{
    Access, ConnectAttr, Context, Cq, Mr, Pd, Provider, ProviderKind, ProviderVisitor, Qp, QpCaps,
    RecvWr, SendFlags, SendWr, Wc, WcError, WrOp,
};

/// Checks RDMA devices, GIDs, memlock and GPU memory support, then ping-pongs on loopback.
#[derive(Parser, Debug)]
#[command(name = "rpc-doctor", version)]
struct Args {
    /// Round trips of the loopback ping-pong (0 skips it).
    #[arg(long, default_value_t = 300)]
    iters: usize,
    /// Message size of the ping-pong in bytes.
    #[arg(long, default_value_t = 64)]
    size: u32,
    /// Device for the ping-pong (`mlx5_0` or `mlx5_0:1`); default: the provider's first.
    #[arg(long)]
    device: Option<String>,
    /// Show the providers' INFO logs (device selection, GID choice, QPs reaching RTS).
    #[arg(short, long)]
    verbose: bool,
}

/// Collects findings; problems make the exit status 1.
#[derive(Default)]
struct Report {
    problems: usize,
}

impl Report {
    fn ok(&mut self, msg: impl AsRef<str>) {
        println!("  [ok] {}", msg.as_ref());
    }
    fn note(&mut self, msg: impl AsRef<str>) {
        println!("  [--] {}", msg.as_ref());
    }
    fn problem(&mut self, msg: impl AsRef<str>, fix: impl AsRef<str>) {
        self.problems += 1;
        println!("  [!!] {}", msg.as_ref());
        println!("       fix: {}", fix.as_ref());
    }
}

fn section(title: &str) {
    println!("\n== {title} ==");
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.verbose {
        tracing_subscriber::fmt()
            .with_env_filter(
                tracing_subscriber::EnvFilter::try_from_default_env()
                    .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
            )
            .with_writer(std::io::stderr)
            .with_ansi(
                std::io::IsTerminal::is_terminal(&std::io::stderr())
                    && std::env::var("TERM").is_ok_and(|t| t != "dumb"),
            )
            .init();
    }
    let mut r = Report::default();
    println!(
        "rpc-doctor {}: is this machine ready for rdma-rpc?",
        env!("CARGO_PKG_VERSION")
    );

    section("Providers");
    let compiled: Vec<&str> = ProviderKind::compiled().iter().map(|p| p.name()).collect();
    r.ok(format!("compiled in: {}", compiled.join(", ")));
    if !cfg!(feature = "ibverbs") {
        r.note(
            "the ib provider (real RNICs, Soft-RoCE) is not compiled in: build with \
             `--features ibverbs` (needs Debian's libibverbs-dev librdmacm-dev libclang1-14 \
             libclang-common-14-dev)",
        );
    }
    let kind = match ProviderKind::from_env() {
        Ok(k) => {
            let how = if std::env::var_os(ProviderKind::ENV).is_some() {
                "from RPC_PROVIDER"
            } else {
                "default; set RPC_PROVIDER=soft|ib to choose"
            };
            r.ok(format!("provider in use: {k} ({how})"));
            Some(k)
        }
        Err(e) => {
            r.problem(
                format!("RPC_PROVIDER is not usable: {e}"),
                "set RPC_PROVIDER=soft, or rebuild with --features ibverbs for ib",
            );
            None
        }
    };

    section("RDMA devices");
    let ib_devices = ib::report(&mut r, kind == Some(ProviderKind::Ib));

    section("Locked memory (RLIMIT_MEMLOCK)");
    memlock(&mut r, kind == Some(ProviderKind::Ib) || ib_devices > 0);

    section("GPU memory (GPUDirect RDMA)");
    gpu(&mut r);

    // The provider in use, and ib too when this machine has RDMA devices.
    let mut kinds: Vec<ProviderKind> = kind.into_iter().collect();
    if ib_devices > 0 && !kinds.contains(&ProviderKind::Ib) {
        kinds.extend(
            ProviderKind::compiled()
                .iter()
                .filter(|k| **k == ProviderKind::Ib),
        );
    }
    for kind in kinds.into_iter().filter(|_| args.iters > 0) {
        section(&format!("Loopback ping-pong ({kind})"));
        let pp = PingPong {
            iters: args.iters,
            size: args.size.max(1),
            device: args.device.clone(),
        };
        match kind.visit(pp) {
            Ok(Ok(s)) => r.ok(s),
            Ok(Err((what, fix))) => r.problem(what, fix),
            Err(e) => r.problem(format!("{e}"), "choose a compiled provider"),
        }
    }

    println!();
    if r.problems == 0 {
        println!("no problems found");
        ExitCode::SUCCESS
    } else {
        println!("{} problem(s) found (see [!!] above)", r.problems);
        ExitCode::FAILURE
    }
}

/// Reads `Max locked memory` of /proc/self/limits: `None` when unlimited.
fn memlock_limit() -> Option<Option<u64>> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    let soft = line.split_whitespace().nth(3)?;
    if soft == "unlimited" {
        Some(None)
    } else {
        soft.parse().ok().map(Some)
    }
}

fn has_cap_ipc_lock() -> bool {
    const CAP_IPC_LOCK: u32 = 14;
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|c| c & (1 << CAP_IPC_LOCK) != 0)
}

fn memlock(r: &mut Report, pinning: bool) {
    const FIX: &str = "`ulimit -l unlimited` in the shell, LimitMEMLOCK=infinity in the systemd \
                       unit, `--ulimit memlock=-1` for docker, or `* - memlock unlimited` in \
                       /etc/security/limits.conf";
    const LOW: u64 = 64 << 20;
    match memlock_limit() {
        None => r.note("cannot read /proc/self/limits"),
        Some(None) => r.ok("unlimited"),
        Some(Some(l)) if has_cap_ipc_lock() => r.ok(format!(
            "{} (not enforced: this process has CAP_IPC_LOCK)",
            mib(l)
        )),
        Some(Some(l)) if l < LOW && pinning => r.problem(
            format!(
                "only {}: registering rings and bulk buffers will fail with ENOMEM",
                mib(l)
            ),
            FIX,
        ),
        Some(Some(l)) if pinning => r.note(format!(
            "{}: enough to start; large bulk registrations may need more ({FIX})",
            mib(l)
        )),
        Some(Some(l)) => r.note(format!(
            "{} (the soft provider pins nothing; real RNICs will need more: {FIX})",
            mib(l)
        )),
    }
}

fn mib(b: u64) -> String {
    if b >= 1 << 20 {
        format!("{} MiB", b >> 20)
    } else {
        format!("{} KiB", b >> 10)
    }
}

fn gpu(r: &mut Report) {
    let nvidia = std::path::Path::new("/sys/module/nvidia").exists();
    let peermem = std::path::Path::new("/sys/module/nvidia_peermem").exists();
    match (nvidia, peermem) {
        (_, true) => r.ok("nvidia_peermem is loaded: GPU memory can be registered"),
        (true, false) => r.problem(
            "an NVIDIA driver is loaded but nvidia_peermem is not: registering GPU memory \
             (GPUDirect RDMA) will fail",
            "`modprobe nvidia-peermem` (part of the NVIDIA driver package)",
        ),
        (false, false) => r.note("no NVIDIA driver loaded: GPU memory is not used here"),
    }
}

/// The loopback ping-pong, generic over the provider chosen at run time.
struct PingPong {
    iters: usize,
    size: u32,
    device: Option<String>,
}

type PpResult = Result<String, (String, String)>;

impl ProviderVisitor for PingPong {
    type Output = PpResult;

    fn visit<P: Provider>(self) -> PpResult {
        let fix_open = match P::NAME {
            "ib" => "see the device checks above",
            _ => "the soft provider needs /dev/shm (shared memory)",
        };
        let ctx = P::open(self.device.as_deref()).map_err(|e| {
            (
                format!("cannot open a {} device: {e}", P::NAME),
                fix_open.to_owned(),
            )
        })?;
        let label = format!("{}:{}", ctx.info().name, ctx.info().port);
        run_pingpong::<P>(&ctx, self.iters, self.size)
            .map(|s| format!("{label}: {s}"))
            .map_err(|e| {
                (
                    format!("ping-pong on {label} failed: {e}"),
                    "run with -v for the provider's log; on RoCE check the GID (RPC_IB_GID_INDEX) \
                     and that the netdev is up"
                        .to_owned(),
                )
            })
    }
}

fn run_pingpong<P: Provider>(ctx: &P::Context, iters: usize, size: u32) -> Result<String, String> {
    let e = |e: rpc_core::verbs::VerbsError| e.to_string();
    let pd = ctx.alloc_pd().map_err(e)?;
    let mut cq_a = ctx.create_cq(64, None).map_err(e)?;
    let mut cq_b = ctx.create_cq(64, None).map_err(e)?;
    let caps = QpCaps {
        max_send_wr: 8,
        max_recv_wr: 8,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: 0,
    };
    let mut a = pd.create_qp(&cq_a, &cq_a, caps).map_err(e)?;
    let mut b = pd.create_qp(&cq_b, &cq_b, caps).map_err(e)?;
    let attr = ConnectAttr::default();
    let (ea, eb) = (a.endpoint(), b.endpoint());
    a.connect(&eb, &attr).map_err(e)?;
    b.connect(&ea, &attr).map_err(e)?;
    let slot = size as usize;
    let mr = pd.alloc_mr(slot * 4, Access::LOCAL_WRITE).map_err(e)?;
    // Slots: 0 = A's send, 1 = B's receive, 2 = B's send, 3 = A's receive.
    let sge = |i: usize| {
        mr.sge(i * slot, size)
            .ok_or("slot outside the region".to_owned())
    };
    let (a_tx, b_rx, b_tx, a_rx) = ([sge(0)?], [sge(1)?], [sge(2)?], [sge(3)?]);
    let recv = |qp: &mut P::Qp, sg: &[rpc_core::verbs::Sge]| {
        // SAFETY: the receive slot lies in `mr`, which outlives both QPs' use of it (the QPs
        // are dropped first at the end of this function), and nothing reads it meanwhile.
        unsafe {
            qp.post_recv(&[RecvWr {
                wr_id: 0,
                sg_list: sg,
            }])
        }
        .map_err(|e| e.to_string())
    };
    let send = |qp: &mut P::Qp, sg: &[rpc_core::verbs::Sge]| {
        let wr = SendWr {
            wr_id: 0,
            op: WrOp::Send,
            sg_list: sg,
            flags: SendFlags::SIGNALED,
        };
        // SAFETY: the send slot lies in `mr` and is not written while the send is outstanding.
        unsafe { qp.post_send(&[wr]) }.map_err(|e| e.to_string())
    };
    recv(&mut b, &b_rx)?;
    recv(&mut a, &a_rx)?;
    let mut lat = Vec::with_capacity(iters);
    let warmup = (iters / 10).min(50);
    for i in 0..iters + warmup {
        let t = Instant::now();
        send(&mut a, &a_tx)?;
        wait(&mut cq_b, 1)?; // B's receive
        recv(&mut b, &b_rx)?;
        send(&mut b, &b_tx)?;
        wait(&mut cq_a, 2)?; // A's send + A's receive
        recv(&mut a, &a_rx)?;
        wait(&mut cq_b, 1)?; // B's send
        if i >= warmup {
            lat.push(t.elapsed());
        }
    }
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() as f64 * p) as usize).min(lat.len() - 1)];
    let avg = lat.iter().sum::<Duration>() / lat.len() as u32;
    Ok(format!(
        "{iters} round trips of {size} B SEND/RECV: p50 {:.1} us, p99 {:.1} us, avg {:.1} us, \
         max {:.1} us",
        us(pct(0.5)),
        us(pct(0.99)),
        us(avg),
        us(lat[lat.len() - 1])
    ))
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// Polls until `n` successful completions arrived (10 s at most).
fn wait<C: Cq>(cq: &mut C, n: usize) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut got = 0;
    let mut wc = [Wc::default(); 4];
    while got < n {
        let k = cq.poll(&mut wc[..n - got]).map_err(|e| e.to_string())?;
        for w in &wc[..k] {
            WcError::check(w).map_err(|e| e.to_string())?;
        }
        got += k;
        if k == 0 {
            if Instant::now() > deadline {
                return Err(format!("no completion within 10 s ({got} of {n})"));
            }
            std::hint::spin_loop();
        }
    }
    Ok(())
}

#[cfg(feature = "ibverbs")]
mod ib {
    use rpc_core::verbs::ib::{self, GidAddr, GidChoice, Ib};
    use rpc_core::verbs::{LinkLayer, Provider};

    use super::Report;

    const NO_DEVICE_FIX: &str = "on a machine with an RDMA NIC load its driver (`modprobe \
        mlx5_ib`); without one, Soft-RoCE turns any Ethernet NIC into an RDMA device: \
        `modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0` (the netdev must have an \
        IP address); RPC_PROVIDER=soft works everywhere (processes of one host)";

    /// Prints every device; returns how many there are.
    pub(super) fn report(r: &mut Report, required: bool) -> usize {
        let devs = match ib::diagnose() {
            Ok(d) => d,
            Err(e) => {
                r.problem(
                    format!("cannot list RDMA devices: {e}"),
                    "check that ib_uverbs is loaded",
                );
                return 0;
            }
        };
        if devs.is_empty() {
            let msg = "no RDMA device on this machine (the ib provider cannot run here)";
            if required {
                r.problem(msg, NO_DEVICE_FIX);
            } else {
                r.note(format!("{msg}; how to get one: {NO_DEVICE_FIX}"));
            }
            return 0;
        }
        r.ok(format!("{} device(s)", devs.len()));
        let mut active = 0;
        for d in &devs {
            let g = d.node_guid.to_be_bytes();
            println!(
                "  {}: fw {}, node GUID {:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}, \
                 vendor {:#x} part {}",
                d.name,
                d.fw_ver,
                g[0],
                g[1],
                g[2],
                g[3],
                g[4],
                g[5],
                g[6],
                g[7],
                d.vendor_id,
                d.vendor_part_id
            );
            let c = &d.caps;
            println!(
                "    caps: max_qp_wr {}, max_sge {}, max_cqe {}, max_inline {}, atomics {}, \
                 rd_atomic {}, max_msg {} B",
                c.max_qp_wr,
                c.max_sge,
                c.max_cqe,
                c.max_inline,
                c.atomics,
                c.max_rd_atomic,
                c.max_msg_size
            );
            for p in &d.ports {
                let i = &p.info;
                let ll = match i.link_layer {
                    LinkLayer::Ethernet => "Ethernet (RoCE)",
                    _ => "InfiniBand",
                };
                let rate = i
                    .rate_gbps
                    .map(|g| format!(", {g} Gb/s"))
                    .unwrap_or_default();
                println!(
                    "    port {}: {}, phys {}, link layer {ll}, active MTU {} (max {}), LID \
                     {:#x}{rate}",
                    i.num,
                    i.state.name(),
                    phys_state(i.phys_state),
                    i.active_mtu,
                    i.max_mtu,
                    i.lid
                );
                if i.is_active() {
                    active += 1;
                } else {
                    r.problem(
                        format!("{}:{} is {}", d.name, i.num, i.state.name()),
                        i.state.fix(),
                    );
                }
                if i.link_layer == LinkLayer::Ethernet || p.gids.len() > 1 {
                    println!("      GID  index  type        netdev    address");
                    for g in &p.gids {
                        let chosen = matches!(&p.chosen, Ok((idx, _)) if *idx == g.index);
                        println!(
                            "      {}  {:>5}  {:<10}  {:<8}  {}{}",
                            if chosen { " * " } else { "   " },
                            g.index,
                            g.kind.name(),
                            g.netdev.as_deref().unwrap_or("-"),
                            GidAddr(&g.gid),
                            if chosen { "   <- used" } else { "" }
                        );
                    }
                }
                match &p.chosen {
                    Ok((idx, why)) => {
                        let why = match why {
                            GidChoice::Forced => "forced by RPC_IB_GID_INDEX",
                            GidChoice::Auto => "automatic: IPv4-mapped RoCE v2 preferred",
                            GidChoice::InfiniBand => "InfiniBand port GID",
                        };
                        println!("      GID index {idx} would be used ({why})");
                        if let Some(g) = p.gids.iter().find(|g| g.index == *idx)
                            && i.link_layer == LinkLayer::Ethernet
                            && g.kind != ib::GidKind::RoceV2
                        {
                            r.note(format!(
                                "{}:{} uses a RoCE v1 GID: v1 is not routable; both ends must \
                                 use the same version (set RPC_IB_GID_INDEX to a RoCE v2 \
                                 entry if the peer uses v2)",
                                d.name, i.num
                            ));
                        }
                    }
                    Err(why) if i.is_active() => r.problem(
                        format!("{}:{}: no usable GID: {why}", d.name, i.num),
                        "assign an IP address to the port's netdev, or fix RPC_IB_GID_INDEX",
                    ),
                    Err(_) => {}
                }
            }
        }
        if active == 0 {
            r.problem("no ACTIVE port: the ib provider cannot run", NO_DEVICE_FIX);
            return devs.len();
        }
        match Ib::hca_spec() {
            Ok(spec) => {
                let shown = if spec.is_all() {
                    "unset: every active port".to_owned()
                } else {
                    spec.to_string()
                };
                match Ib::open_rails() {
                    Ok(rails) => {
                        let l: Vec<String> = rails
                            .iter()
                            .map(|c| format!("[{}]{}", c.rail(), c.label()))
                            .collect();
                        r.ok(format!("RPC_IB_HCA {shown} -> rails {}", l.join(" ")));
                    }
                    Err(e) => r.problem(
                        format!("RPC_IB_HCA {shown}: {e}"),
                        "list devices as `mlx5_0:1,mlx5_1` (see above for names), or unset it",
                    ),
                }
            }
            Err(e) => r.problem(format!("{e}"), "fix or unset RPC_IB_HCA"),
        }
        match <Ib as Provider>::qps_per_connection() {
            Ok(n) => r.ok(format!(
                "QPs per connection: {n} (RPC_IB_QPS_PER_CONNECTION)"
            )),
            Err(e) => r.problem(format!("{e}"), "set RPC_IB_QPS_PER_CONNECTION to 1..=16"),
        }
        if !std::path::Path::new("/dev/infiniband").exists() {
            r.problem(
                "/dev/infiniband is missing: user-space verbs cannot reach the devices",
                "`modprobe ib_uverbs`; in a container pass `--device /dev/infiniband`",
            );
        }
        devs.len()
    }

    fn phys_state(s: u8) -> &'static str {
        match s {
            1 => "Sleep",
            2 => "Polling",
            3 => "Disabled",
            4 => "PortConfigurationTraining",
            5 => "LinkUp",
            6 => "LinkErrorRecovery",
            7 => "PhyTest",
            _ => "unknown",
        }
    }
}

#[cfg(not(feature = "ibverbs"))]
mod ib {
    use super::Report;

    /// Without the ib provider, only sysfs can tell whether the machine has RDMA devices.
    pub(super) fn report(r: &mut Report, _required: bool) -> usize {
        let names: Vec<String> = std::fs::read_dir("/sys/class/infiniband")
            .map(|d| {
                d.filter_map(|e| e.ok())
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        if names.is_empty() {
            r.note(
                "no RDMA device on this machine. Without RDMA hardware: Soft-RoCE on an Ethernet \
                 NIC (`modprobe rdma_rxe && rdma link add rxe0 type rxe netdev eth0`), or keep \
                 RPC_PROVIDER=soft, which works everywhere",
            );
        } else {
            r.note(format!(
                "RDMA devices present ({}), but this build has no ib provider: rebuild with \
                 `--features ibverbs` to use them",
                names.join(", ")
            ));
        }
        names.len()
    }
}
