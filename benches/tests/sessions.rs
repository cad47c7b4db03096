//! `rpc-bench sessions` end to end in a tiny configuration: both systems, 1 and 10
//! connections from 2 client processes; the JSON file has every figure, and nothing failed.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_rpc-bench");

#[test]
fn sessions_tiny_run_reports_every_figure() {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let dir =
        std::env::temp_dir().join(format!("rpc-bench-sessions-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("sessions.json");
    let mut child = Command::new(EXE)
        .args([
            "sessions",
            "--counts",
            "1,10",
            "--client-procs",
            "2",
            "--load-secs",
            "0.3",
            "--settle-ms",
            "200",
            "--phase-secs",
            "20",
            "--max-secs",
            "60",
            "--json",
        ])
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "rpc-bench sessions failed:\n{text}");
    assert!(text.contains("calls/s"), "no table printed:\n{text}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let cells = report["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 4, "{report:#}");
    for c in cells {
        let what = format!("{} x {}", c["system"], c["count"]);
        let count = c["count"].as_u64().unwrap();
        assert_eq!(c["opened"].as_u64(), Some(count), "{what}: {c:#}");
        assert_eq!(c["failed"].as_u64(), Some(0), "{what}: {c:#}");
        assert_eq!(c["not_attempted"].as_u64(), Some(0), "{what}: {c:#}");
        assert!(c["first_error"].is_null(), "{what}: {c:#}");
        let cf = &c["connect_first_call"];
        assert_eq!(cf["n"].as_u64(), Some(count), "{what}: {c:#}");
        assert!(cf["p50_us"].as_f64().unwrap() > 0.0, "{what}: {c:#}");
        assert!(cf["p99_us"].as_f64().unwrap() >= cf["p50_us"].as_f64().unwrap());
        for phase in ["server_idle", "server_open"] {
            assert!(
                c[phase]["vm_rss_kib"].as_u64().unwrap() > 0,
                "{what}: {c:#}"
            );
            assert!(c[phase]["fds"].as_u64().unwrap() > 0, "{what}: {c:#}");
        }
        assert!(c["server_kib_per_conn"].as_f64().is_some(), "{what}: {c:#}");
        // Every connection holds at least its own socket in the server.
        assert!(
            c["server_fds_per_conn"].as_f64().unwrap() >= 1.0,
            "{what}: {c:#}"
        );
        let load = &c["load"];
        assert_eq!(load["active"].as_u64(), Some(1), "{what}: {c:#}");
        assert!(load["calls"].as_u64().unwrap() > 0, "{what}: {c:#}");
        assert_eq!(load["errors"].as_u64(), Some(0), "{what}: {c:#}");
        assert!(load["calls_per_s"].as_f64().unwrap() > 0.0, "{what}: {c:#}");
        assert!(
            load["latency"]["p50_us"].as_f64().unwrap() > 0.0,
            "{what}: {c:#}"
        );
    }
    assert!(json.with_extension("txt").exists());
    assert!(json.with_extension("png").exists());
    assert!(json.with_extension("svg").exists());
    let _ = std::fs::remove_dir_all(&dir);
}
