//! `rpc-bench windows`: what revocable remote access costs per large call. Every large call
//! lends a buffer to the peer through a fresh key (`Pd::bind_window`) and revokes it when the
//! loan ends (dropping the window); this times the pair against the RDMA READ of the same
//! bytes it protects, on two connected QPs of one process (one device, loopback).

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use rpc_core::verbs::{
    Access, ConnectAttr, Context, Cq, Mr, Pd, Provider, ProviderKind, ProviderVisitor, Qp, QpCaps,
    SendFlags, SendWr, Wc, WcStatus, WrOp,
};

/// Arguments of `rpc-bench windows`.
#[derive(Debug, clap::Args)]
pub struct WindowArgs {
    /// Buffer sizes (K/M/GiB suffixes), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64KiB,1MiB,16MiB")]
    sizes: Vec<String>,
    /// Bind-and-revoke pairs (and READs) timed per size.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Write the figures as JSON here too.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

/// One size's figures (nanoseconds, medians over the iterations).
#[derive(Debug, serde::Serialize)]
struct Row {
    size: usize,
    bind_ns: u64,
    revoke_ns: u64,
    read_ns: u64,
}

/// Runs the measurement on the provider `RPC_PROVIDER` names and prints the table.
///
/// # Errors
/// When the device or a verb fails.
pub fn run(args: &WindowArgs) -> Result<()> {
    let kind = ProviderKind::from_env().map_err(|e| anyhow!("{e}"))?;
    let sizes = args
        .sizes
        .iter()
        .map(|s| crate::runner::parse_size(s).map_err(|e| anyhow!(e)))
        .collect::<Result<Vec<_>>>()?;
    let rows = kind.visit(Measure {
        sizes,
        iters: args.iters.max(1),
    })??;
    let mut table = format!(
        "Revocable remote access per large call ({kind}, {} iterations per size)\n\n\
         | size | bind window | revoke | bind + revoke | RDMA READ of the bytes | share |\n\
         |---:|---:|---:|---:|---:|---:|\n",
        args.iters
    );
    for r in &rows {
        let pair = r.bind_ns + r.revoke_ns;
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.1}% |\n",
            crate::report::size_name(r.size),
            fmt_ns(r.bind_ns),
            fmt_ns(r.revoke_ns),
            fmt_ns(pair),
            fmt_ns(r.read_ns),
            100.0 * pair as f64 / (pair + r.read_ns).max(1) as f64
        ));
    }
    print!("{table}");
    if let Some(path) = &args.json {
        let doc =
            serde_json::json!({ "provider": kind.to_string(), "iters": args.iters, "rows": rows });
        std::fs::write(path, serde_json::to_vec_pretty(&doc)?)
            .with_context(|| format!("write {}", path.display()))?;
        println!("\nJSON: {}", path.display());
    }
    Ok(())
}

fn fmt_ns(ns: u64) -> String {
    if ns >= 10_000 {
        format!("{:.1} µs", ns as f64 / 1000.0)
    } else {
        format!("{ns} ns")
    }
}

struct Measure {
    sizes: Vec<usize>,
    iters: usize,
}

impl ProviderVisitor for Measure {
    type Output = Result<Vec<Row>>;
    fn visit<P: Provider>(self) -> Result<Vec<Row>> {
        let ctx = P::open(None).context("windows: open the device")?;
        let pd = ctx.alloc_pd().context("windows: alloc_pd")?;
        let mut cq = ctx.create_cq(64, None).context("windows: create_cq")?;
        let caps = QpCaps {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let mut owner = pd.create_qp(&cq, &cq, caps).context("create_qp")?;
        let mut reader = pd.create_qp(&cq, &cq, caps).context("create_qp")?;
        let attr = ConnectAttr::default();
        let (eo, er) = (owner.endpoint(), reader.endpoint());
        owner.connect(&er, &attr).context("windows: connect")?;
        reader.connect(&eo, &attr).context("windows: connect")?;
        let mut rows = Vec::new();
        for &size in &self.sizes {
            let src = pd.alloc_mr(size, Access::LOCAL_WRITE).context("alloc_mr")?;
            let dst = pd.alloc_mr(size, Access::LOCAL_WRITE).context("alloc_mr")?;
            let (mut bind, mut revoke, mut read) = (Vec::new(), Vec::new(), Vec::new());
            for _ in 0..self.iters {
                let t = Instant::now();
                let w = pd
                    .bind_window(&src, 0, size, Access::REMOTE_READ, &owner)
                    .context("bind_window")?;
                bind.push(t.elapsed());
                let t = Instant::now();
                read_all::<P>(&mut reader, &mut cq, &dst, &w)?;
                read.push(t.elapsed());
                let t = Instant::now();
                drop(w);
                revoke.push(t.elapsed());
            }
            rows.push(Row {
                size,
                bind_ns: median(&mut bind),
                revoke_ns: median(&mut revoke),
                read_ns: median(&mut read),
            });
        }
        Ok(rows)
    }
}

/// READs all of window `w` into `dst` through `qp` and waits for the completion.
fn read_all<P: Provider>(qp: &mut P::Qp, cq: &mut P::Cq, dst: &P::Mr, w: &P::Mr) -> Result<()> {
    let len = u32::try_from(w.len()).map_err(|_| anyhow!("a READ of over 4 GiB"))?;
    let sge = [dst.sge(0, len).ok_or_else(|| anyhow!("no SGE"))?];
    let wr = SendWr {
        wr_id: 1,
        op: WrOp::Read {
            remote_addr: w.addr(),
            rkey: w.rkey(),
        },
        sg_list: &sge,
        flags: SendFlags::SIGNALED,
    };
    // SAFETY: `dst` outlives the READ (its completion is polled below) and is not touched
    // meanwhile; the window covers exactly the bytes read.
    unsafe { qp.post_send(&[wr]) }.map_err(|e| anyhow!("post READ: {e}"))?;
    let mut wcs = [Wc::default(); 4];
    let start = Instant::now();
    loop {
        let n = cq.poll(&mut wcs).context("poll")?;
        if let Some(wc) = wcs[..n].first() {
            if wc.status != WcStatus::Success {
                bail!("READ failed: {:?}", wc.status);
            }
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(10) {
            bail!("READ did not complete within 10 s");
        }
        std::hint::spin_loop();
    }
}

fn median(v: &mut [Duration]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}
