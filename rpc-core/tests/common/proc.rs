//! Child processes for the tests that kill a peer: the test binary re-executes itself to run
//! one ignored "entry" test with `RPC_TEST_CHILD` set, and the two talk over the child's
//! stdin/stdout. The child reports with lines `RPCTEST <key> <value>` on stdout and exits when
//! its stdin closes (so it never outlives the parent); the parent SIGKILLs it on drop.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The environment variable naming the child's role.
pub const ROLE_ENV: &str = "RPC_TEST_CHILD";

/// The role of this process when it is a child, if it is one.
pub fn child_role() -> Option<String> {
    std::env::var(ROLE_ENV).ok()
}

/// A child process running one entry test of this binary.
#[derive(Debug)]
pub struct ChildProc {
    child: Option<std::process::Child>,
    lines: mpsc::Receiver<String>,
    stdin: Option<std::process::ChildStdin>,
}

impl ChildProc {
    /// Runs the ignored test `entry` of this binary as a child with role `role` and `env`.
    pub fn spawn(entry: &str, role: &str, env: &[(&str, String)]) -> ChildProc {
        let exe = std::env::current_exe().expect("current_exe");
        let mut cmd = Command::new(exe);
        cmd.args([
            entry,
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, role)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn the child process");
        let stdout = child.stdout.take().expect("child stdout");
        let stdin = child.stdin.take();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may have printed `test name ... ` before it on the same line.
                if let Some(at) = line.find("RPCTEST ")
                    && tx.send(line[at + 8..].to_owned()).is_err()
                {
                    break;
                }
            }
        });
        ChildProc {
            child: Some(child),
            lines: rx,
            stdin,
        }
    }

    /// Waits for the child's report `key` and returns its value; panics after `limit` or when
    /// the child exits first.
    pub fn expect(&mut self, key: &str, limit: Duration) -> String {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(line) => {
                    let (k, v) = line.split_once(' ').unwrap_or((line.as_str(), ""));
                    if k == key {
                        return v.to_owned();
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("child did not report `{key}` within {limit:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.child.as_mut().and_then(|c| c.wait().ok());
                    panic!("child exited ({status:?}) before reporting `{key}`")
                }
            }
        }
    }

    /// Waits for the child's report `key` (returns its value, or `None` when the child exited
    /// first) and hands every other report to `other`; panics after `limit`.
    pub fn collect_until(
        &mut self,
        key: &str,
        limit: Duration,
        mut other: impl FnMut(&str, &str),
    ) -> Option<String> {
        let end = Instant::now() + limit;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left.max(Duration::from_millis(1))) {
                Ok(line) => {
                    let (k, v) = line.split_once(' ').unwrap_or((line.as_str(), ""));
                    if k == key {
                        return Some(v.to_owned());
                    }
                    other(k, v);
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    panic!("child did not report `{key}` within {limit:?}")
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Sends a line to the child's stdin.
    pub fn tell(&mut self, line: &str) {
        if let Some(s) = self.stdin.as_mut() {
            let _ = writeln!(s, "{line}");
            let _ = s.flush();
        }
    }

    /// SIGKILLs the child and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The child's process id.
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// In a child: reports `key value` to the parent.
pub fn report(key: &str, value: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "RPCTEST {key} {value}");
    let _ = out.flush();
}

/// In a child: exits the process when the parent closes stdin (or dies), or after `limit`.
pub fn exit_with_parent(limit: Duration) {
    exit_with_parent_and(limit, |_| {});
}

/// As [`exit_with_parent`], handing every line the parent tells to `on_line`.
pub fn exit_with_parent_and(limit: Duration, on_line: impl Fn(&str) + Send + 'static) {
    let (tx, rx) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        let mut line = String::new();
        let stdin = std::io::stdin();
        loop {
            line.clear();
            match stdin.lock().read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => on_line(line.trim()),
            }
        }
        let _ = tx.send(());
    });
    std::thread::spawn(move || {
        let _ = rx.recv_timeout(limit);
        std::process::exit(0);
    });
}
