//! `rpc-bench`: rdma-rpc against gRPC (tonic 0.14) on the same `proto/bench.proto`, side by
//! side in one run, with the raw provider's SEND/RECV ping-pong as the floor (issue 6), and
//! the runtime's own speed figures (issue 3).
//!
//! ```text
//! rpc-bench run [--quick] [--json PATH] ...      one host: starts `serve` as a child
//! rpc-bench serve --listen ADDR                  server host of the two-host mode
//! rpc-bench run --connect ADDR ...               client host of the two-host mode
//! rpc-bench sessions [--counts 1,100,...] ...     many connections to one server (issue 14)
//! ```
//!
//! Processes: the runner is the client of every measurement (pinned to core 1); the server
//! side is a supervisor (`serve`) that starts one server process per measured cell (pinned to
//! core 0), so servers and clients always live in separate processes and a busy-polling server
//! never runs beside another system's measurement. Every process is bounded in time and dies
//! with its parent.
//!
//! `cargo bench -p rpc-bench` runs `rpc-bench run --quick`.

pub mod client;
pub mod control;
pub mod layers;
pub mod load;
pub mod measure;
pub mod plot;
pub mod raw;
pub mod report;
pub mod rpc_client;
pub mod runner;
pub mod server;
pub mod service;
pub mod sessions;
pub mod sessions_client;
pub mod sessions_plot;
pub mod stream;
pub mod stream_report;
pub mod sys;
pub mod tonic_client;
pub mod windows;

/// Messages, rdma-rpc client and server, tonic client and server, generated from
/// `proto/bench.proto` by `build.rs`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    include!(concat!(env!("OUT_DIR"), "/bench.rs"));
}

use std::ffi::OsString;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The command line.
#[derive(Debug, Parser)]
#[command(
    name = "rpc-bench",
    version,
    about = "rdma-rpc against gRPC (tonic) on the same .proto, with the raw provider as the floor"
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the benchmark (the default).
    Run(Box<runner::RunArgs>),
    /// Serve benchmark servers for a runner on another host (two-host mode).
    Serve(ServeArgs),
    /// One benchmark server process (started by `serve`).
    #[command(hide = true)]
    Server(server::ServerArgs),
    /// What revocable remote access costs per large call (bind + revoke against the READ).
    Windows(windows::WindowArgs),
    /// What interceptors, call statistics, tracing and balancing cost a small call.
    Layers(layers::LayerArgs),
    /// Many connections to one server with one shard, rdma-rpc and tonic (issue 14).
    Sessions(Box<sessions::SessionArgs>),
    /// One client process of `sessions` (started by `sessions`).
    #[command(hide = true)]
    SessionsClient(sessions_client::SessionClientArgs),
    /// Busy threads for `run --background-load` (started by `run`).
    #[command(hide = true)]
    Load(load::LoadArgs),
}

/// Arguments of `rpc-bench serve`.
#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Control address to listen on; benchmark servers bind the same IP.
    #[arg(long, default_value = "0.0.0.0:7470")]
    listen: String,
    /// Serve one runner, then exit.
    #[arg(long)]
    once: bool,
    /// Exit after this many seconds.
    #[arg(long)]
    max_secs: Option<u64>,
    /// Exit when the parent process dies.
    #[arg(long, hide = true)]
    die_with_parent: bool,
}

/// Runs the command line `args` (program name first); returns the process's exit code.
pub fn main_with(args: Vec<OsString>) -> ExitCode {
    let command = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ");
    let cli = match Cli::try_parse_from(&args) {
        Ok(c) => c,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let result = match cli.cmd {
        Some(Cmd::Serve(s)) => control::supervise(&control::SuperviseOpts {
            listen: s.listen,
            once: s.once,
            max_secs: s.max_secs,
            die_with_parent: s.die_with_parent,
        }),
        Some(Cmd::Server(s)) => server::run(&s),
        Some(Cmd::Windows(w)) => windows::run(&w),
        Some(Cmd::Layers(l)) => layers::run(&l),
        Some(Cmd::Load(l)) => load::run(&l),
        Some(Cmd::Sessions(s)) => sessions::run(&s, command),
        Some(Cmd::SessionsClient(c)) => sessions_client::run(&c),
        Some(Cmd::Run(r)) => run_and_print(&r, command),
        None => match Cli::try_parse_from(["rpc-bench", "run"]) {
            Ok(Cli {
                cmd: Some(Cmd::Run(r)),
            }) => run_and_print(&r, command),
            _ => Err(anyhow::anyhow!("default arguments do not parse")),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("rpc-bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo bench` entry: the bench executable stands in for `rpc-bench` (it starts copies of
/// itself as server processes). Without a subcommand it runs `run --quick`, writing
/// `bench-out/results.json` at the workspace root (cargo runs benches in the package
/// directory); cargo's `--bench` flag and test-name filters are dropped.
pub fn bench_main() -> ExitCode {
    let mut args: Vec<OsString> = std::env::args_os().collect();
    let is_sub = args
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|a| matches!(a, "run" | "serve" | "server"));
    if is_sub {
        return main_with(args);
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map_or_else(
            || std::path::PathBuf::from("."),
            std::path::Path::to_path_buf,
        );
    args.truncate(1);
    args.extend(["run", "--quick", "--json"].map(OsString::from));
    args.push(root.join("bench-out").join("results.json").into_os_string());
    main_with(args)
}

fn run_and_print(args: &runner::RunArgs, command: String) -> anyhow::Result<()> {
    let report = runner::run(args, command)?;
    println!(
        "rpc-bench: {} (server: {}); load average {} before, {} after; {:.0} s",
        report.machine.describe(),
        report.server_machine,
        fmt_load(report.load_before),
        fmt_load(report.load_after),
        report.seconds
    );
    println!();
    // `--streaming-only` measured no unary phase: no unary table and no targets.
    let mut table = if args.streaming_only {
        String::new()
    } else {
        report::table(&report, &args.outstanding, runner::LARGE_FROM)
    };
    let provider = report.config["provider"].as_str().unwrap_or("soft");
    match &report.streaming {
        Some(s) => {
            table.push('\n');
            table.push_str(&stream_report::table(s, &report.config["reps"], provider));
        }
        None => table.push_str("\nStreaming: not measured in this run.\n"),
    }
    print!("{table}");
    // The same table beside the JSON file, with the command and machine, for the README.
    let txt = args.json.with_extension("txt");
    let header = format!(
        "$ {}\n{}; load average {} before, {} after\n\n",
        report.command,
        report.machine.describe(),
        fmt_load(report.load_before),
        fmt_load(report.load_after)
    );
    if let Err(e) = std::fs::write(&txt, header + &table) {
        eprintln!("rpc-bench: {}: {e}", txt.display());
    }
    println!("\nJSON: {}", args.json.display());
    if !args.no_plots {
        let dir = args
            .plots
            .clone()
            .or_else(|| args.json.parent().map(std::path::Path::to_path_buf))
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or_else(|| std::path::PathBuf::from("."));
        let title = format!("{provider} provider, {}", report.machine.cpu);
        // No unary phase ran with `--streaming-only`: no latency or throughput plot.
        let mut plots = if args.streaming_only {
            Ok(Vec::new())
        } else {
            plot::write_all(&dir, &report.rows, provider, &title)
        };
        if let (Ok(files), Some(s)) = (&mut plots, &report.streaming) {
            let data = plot::StreamPlot {
                rows: &s.rows,
                ratios: &s.ratios,
                pipeline: s.pipeline,
            };
            match plot::write_streaming(&dir, data, provider, &title) {
                Ok(more) => files.extend(more),
                Err(e) => plots = Err(e),
            }
        }
        match plots {
            Ok(files) => {
                for f in files {
                    println!("plot: {}", f.display());
                }
            }
            Err(e) => eprintln!("rpc-bench: plots not written: {e:#}"),
        }
    }
    if !report.errors.is_empty() {
        anyhow::bail!(
            "{} measurement(s) failed (recorded in the JSON file); first: {}",
            report.errors.len(),
            report.errors[0]
        );
    }
    Ok(())
}

fn fmt_load(l: Option<[f64; 3]>) -> String {
    l.map_or("unknown".into(), |l| {
        format!("{:.2}/{:.2}/{:.2}", l[0], l[1], l[2])
    })
}
