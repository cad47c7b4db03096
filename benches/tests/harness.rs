//! End to end: the harness runs every system in separate processes and writes its JSON file
//! and plots; the two-host mode works through `serve --listen` on loopback. Short phases: these
//! check that figures are produced, not how fast anything is.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_rpc-bench");

fn scratch(name: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir = std::env::temp_dir().join(format!("rpc-bench-{name}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `rpc-bench` with `args`, killed after `limit`; returns (success, stdout + stderr).
fn run(args: &[&str], limit: Duration) -> (bool, String) {
    let mut child = Command::new(EXE)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (status.is_some_and(|s| s.success()), text)
}

fn json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn row<'a>(report: &'a serde_json::Value, system: &str, size: u64) -> &'a serde_json::Value {
    report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["system"] == system && r["size"] == size)
        .unwrap_or_else(|| panic!("no row for {system} {size}"))
}

const SHORT: &[&str] = &[
    "--reps",
    "1",
    "--warmup-secs",
    "0.01",
    "--latency-secs",
    "0.05",
    "--rate-secs",
    "0.05",
    "--outstanding",
    "4",
    "--no-progress",
    "--max-secs",
    "150",
];

#[test]
fn one_host_run_measures_every_system_and_writes_json_and_plots() {
    let dir = scratch("one-host");
    let json_path = dir.join("results.json");
    let mut args = vec![
        "run",
        "--quick",
        "--sizes",
        "32,64KiB",
        "--systems",
        "rpc,tonic-ct,tonic-mt,raw",
        "--json",
        json_path.to_str().unwrap(),
    ];
    args.extend_from_slice(SHORT);
    let (ok, out) = run(&args, Duration::from_secs(180));
    assert!(ok, "rpc-bench run failed:\n{out}");
    assert!(out.contains("rdma-rpc"), "no table:\n{out}");
    let r = json(&json_path);
    assert_eq!(r["errors"].as_array().unwrap().len(), 0, "{out}");
    for system in ["rpc", "tonic-ct", "tonic-mt", "raw"] {
        for size in [32, 64 << 10] {
            let row = row(&r, system, size);
            assert_eq!(row["reps"], 1, "{system} {size}");
            assert!(row["p50_us"].as_f64().unwrap() > 0.0, "{system} {size}");
            assert!(
                row["p999_us"].as_f64().unwrap() >= row["p50_us"].as_f64().unwrap(),
                "{system} {size}"
            );
            for k in ["1", "4"] {
                let rate = &row["rates"][k];
                assert!(
                    rate["calls_per_s"].as_f64().unwrap() > 0.0,
                    "{system} {size} @{k}"
                );
                assert!(
                    rate["cpu_us_per_call"].as_f64().unwrap() > 0.0,
                    "{system} {size} @{k}"
                );
            }
        }
    }
    // The soft RNIC's own count: one copy of each payload byte, two work requests per small
    // call for the raw ping-pong; tonic's rows count nothing.
    let raw = row(&r, "raw", 64 << 10);
    assert_eq!(raw["nic_ops_per_call"].as_f64().unwrap(), 2.0);
    assert_eq!(
        raw["nic_bytes_per_call"].as_f64().unwrap(),
        2.0 * f64::from(64u32 << 10)
    );
    assert!(row(&r, "rpc", 32)["nic_ops_per_call"].as_f64().unwrap() >= 2.0);
    assert_eq!(
        row(&r, "tonic-ct", 32)["nic_ops_per_call"]
            .as_f64()
            .unwrap(),
        0.0
    );
    // Ratios against tonic and the raw floor, and every target with a verdict or "not
    // measured" (16 MiB and 64 outstanding were not run).
    let ratio32 = r["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["size"] == 32)
        .unwrap();
    assert!(ratio32["p50"].as_f64().unwrap() > 0.0);
    assert!(ratio32["rpc_over_raw_p50"].as_f64().unwrap() > 0.0);
    let targets = r["targets"].as_array().unwrap();
    assert_eq!(targets.len(), 9);
    let i3 = &r["issue3"];
    assert!(i3["calls_per_s_32"].as_f64().unwrap() > 0.0);
    assert!(i3["goodput_4mib_gbps"].as_f64().unwrap() > 0.0);
    assert!(i3["memcpy_4mib_gbps"].as_f64().unwrap() > 0.0);
    // Streaming (issue 7): every phase of every streaming system at both sizes, ratios
    // against tonic, no failures.
    let st = &r["streaming"];
    assert_eq!(st["errors"].as_array().unwrap().len(), 0, "{out}");
    assert_eq!(st["pipeline"], 8);
    for system in ["rpc", "tonic-ct", "tonic-mt"] {
        for size in [32, 64 << 10] {
            let row = st["rows"]
                .as_array()
                .unwrap()
                .iter()
                .find(|x| x["system"] == system && x["size"] == size)
                .unwrap_or_else(|| panic!("no streaming row for {system} {size}"));
            assert_eq!(row["reps"], 1, "{system} {size}");
            let p50 = row["p50_us"].as_f64().unwrap();
            assert!(p50 > 0.0, "{system} {size}");
            assert!(row["p99_us"].as_f64().unwrap() >= p50, "{system} {size}");
            for phase in ["server_stream", "bidi"] {
                let f = &row[phase];
                assert!(
                    f["msgs_per_s"].as_f64().unwrap() > 0.0,
                    "{system} {size} {phase}"
                );
                assert!(
                    f["goodput_gbps"].as_f64().unwrap() > 0.0,
                    "{system} {size} {phase}"
                );
                assert!(
                    f["cpu_us_per_msg"].as_f64().unwrap() > 0.0,
                    "{system} {size} {phase}"
                );
            }
        }
    }
    assert!(
        st["rows"]
            .as_array()
            .unwrap()
            .iter()
            .all(|x| x["system"] != "raw"),
        "the raw ping-pong has no streaming"
    );
    for cell in st["cells"].as_array().unwrap() {
        let ss = &cell["server_stream"];
        // Whole calls of the planned number of messages.
        let per_call = st["messages_per_call"][cell["size"].to_string()]
            .as_u64()
            .unwrap();
        assert_eq!(
            ss["messages"].as_u64().unwrap(),
            ss["calls"].as_u64().unwrap() * per_call,
            "{cell}"
        );
    }
    let sr = st["ratios"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["size"] == 32)
        .unwrap();
    for fig in ["p50", "p99", "server_stream", "bidi"] {
        assert!(sr[fig].as_f64().unwrap() > 0.0, "{fig}");
    }
    assert!(
        out.contains("Streaming (issue 7)"),
        "no streaming table:\n{out}"
    );
    for name in ["latency", "throughput", "streaming"] {
        let png = std::fs::read(dir.join(format!("{name}.png"))).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n", "{name}.png");
        let svg = std::fs::read_to_string(dir.join(format!("{name}.svg"))).unwrap();
        assert!(
            svg.contains("<svg") && svg.contains("rdma-rpc"),
            "{name}.svg"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_host_mode_runs_through_serve_listen() {
    let dir = scratch("two-host");
    let json_path = dir.join("results.json");
    let mut serve = Command::new(EXE)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--once",
            "--max-secs",
            "120",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(serve.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().strip_prefix("LISTEN ").unwrap().to_string();
    let mut args = vec![
        "run",
        "--connect",
        &addr,
        "--sizes",
        "256",
        "--systems",
        "rpc,raw",
        "--no-issue3",
        "--no-plots",
        "--json",
        json_path.to_str().unwrap(),
    ];
    args.extend_from_slice(SHORT);
    let (ok, out) = run(&args, Duration::from_secs(120));
    // `--once`: the supervisor exits when the runner disconnects.
    let start = Instant::now();
    while serve.try_wait().unwrap().is_none() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let exited = serve.try_wait().unwrap().is_some();
    if !exited {
        let _ = serve.kill();
        let _ = serve.wait();
    }
    assert!(ok, "rpc-bench run --connect failed:\n{out}");
    assert!(exited, "serve --once did not exit after the runner left");
    let r = json(&json_path);
    assert!(row(&r, "rpc", 256)["p50_us"].as_f64().unwrap() > 0.0);
    assert!(row(&r, "raw", 256)["p50_us"].as_f64().unwrap() > 0.0);
    assert_eq!(r["config"]["two_host"], addr.as_str());
    assert!(r["issue3"]["p50_us"].is_null());
    // Streaming across the two "hosts": rdma-rpc only (raw has none), so no ratios.
    let st = &r["streaming"];
    let rows = st["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1, "{st}");
    assert_eq!(rows[0]["system"], "rpc");
    assert!(rows[0]["p50_us"].as_f64().unwrap() > 0.0);
    assert!(rows[0]["server_stream"]["msgs_per_s"].as_f64().unwrap() > 0.0);
    assert!(st["ratios"].as_array().unwrap().is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_arguments_are_refused_with_a_reason() {
    let (ok, out) = run(
        &["run", "--sizes", "3XB", "--no-progress"],
        Duration::from_secs(30),
    );
    assert!(!ok);
    assert!(out.contains("bad size unit"), "{out}");
    let (ok, out) = run(
        &["run", "--outstanding", "0", "--no-progress"],
        Duration::from_secs(30),
    );
    assert!(!ok);
    assert!(out.contains("outstanding counts"), "{out}");
    let (ok, out) = run(
        &["run", "--stream-pipeline", "999", "--no-progress"],
        Duration::from_secs(30),
    );
    assert!(!ok);
    assert!(out.contains("--stream-pipeline"), "{out}");
    let (ok, out) = run(
        &["run", "--connect", "127.0.0.1:1", "--no-progress"],
        Duration::from_secs(30),
    );
    assert!(!ok);
    assert!(out.contains("connect to `rpc-bench serve`"), "{out}");
}

#[test]
fn windows_times_bind_and_revoke_against_the_read_and_writes_json() {
    let dir = scratch("windows");
    let path = dir.join("windows.json");
    let (ok, out) = run(
        &[
            "windows",
            "--sizes",
            "64KiB,1MiB",
            "--iters",
            "20",
            "--json",
            path.to_str().unwrap(),
        ],
        Duration::from_secs(120),
    );
    assert!(ok, "{out}");
    assert!(out.contains("| 1 MiB |"), "{out}");
    let doc = json(&path);
    let rows = doc["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for r in rows {
        // A READ of 64 KiB or more always takes time; a window is bound and revoked.
        assert!(r["read_ns"].as_u64().unwrap() > 0, "{r}");
        assert!(r["bind_ns"].as_u64().is_some() && r["revoke_ns"].as_u64().is_some());
    }
    let _ = std::fs::remove_dir_all(&dir);
}
