//! The control protocol between the runner (the client side of every measurement) and the
//! server host.
//!
//! `rpc-bench serve --listen ADDR` is a supervisor: it waits on a TCP control connection and,
//! on command, starts one benchmark server process (`rpc-bench server ...`, a child of its own),
//! reports that process's CPU time, and stops it. It uses no CPU between commands, so a
//! busy-polling server of one system never runs beside another system's measurement. On one
//! host the runner starts the supervisor itself (`--once`, bound to loopback); on a cluster it
//! runs on the server host and the runner reaches it with `--connect ADDR`.
//!
//! Lines, one command each, answered by one line (`ERR <why>` on failure):
//!
//! ```text
//! START <args of `rpc-bench server`>   -> READY <data port>
//! CPU                                  -> CPU <user ns> <sys ns> <nic bytes> <nic ops>
//!                                         (of the server process; nic: its soft RNICs)
//! STOP                                 -> STOPPED
//! INFO                                 -> INFO <machine description>
//! BYE                                  -> (connection closed)
//! ```
//!
//! The server process answers `CPU` and `QUIT` on its standard input the same way; it exits
//! when its input closes, when its parent dies, and after `--max-secs` in any case.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};

use crate::measure::Machine;
use crate::sys::CpuTime;

/// How long a control answer may take.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a stopping server process may take before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// Options of the supervisor.
#[derive(Clone, Debug)]
pub struct SuperviseOpts {
    /// Where to listen for the runner.
    pub listen: String,
    /// Serve one control connection, then exit.
    pub once: bool,
    /// Exit after this long in any case.
    pub max_secs: Option<u64>,
    /// Die with the parent process (set when the runner started us).
    pub die_with_parent: bool,
}

/// Runs the supervisor until its control connection ends (`once`) or forever.
///
/// # Errors
/// When the listener cannot be bound.
pub fn supervise(opts: &SuperviseOpts) -> Result<()> {
    if opts.die_with_parent && !crate::sys::die_with_parent() {
        bail!("parent process already gone");
    }
    if let Some(s) = opts.max_secs {
        watchdog(Duration::from_secs(s), "serve");
    }
    let listener =
        TcpListener::bind(&opts.listen).with_context(|| format!("bind {}", opts.listen))?;
    let local = listener.local_addr()?;
    // The first line of our output tells a parent runner where we are.
    println!("LISTEN {local}");
    std::io::stdout().flush()?;
    eprintln!(
        "rpc-bench serve: control on {local}; servers bind {}:0",
        local.ip()
    );
    loop {
        let (stream, peer) = listener.accept().context("accept control connection")?;
        eprintln!("rpc-bench serve: runner connected from {peer}");
        if let Err(e) = session(stream, local) {
            eprintln!("rpc-bench serve: session with {peer} ended: {e:#}");
        }
        if opts.once {
            return Ok(());
        }
    }
}

/// Exits the process after `after`, whatever it is doing: every run is bounded in time.
pub fn watchdog(after: Duration, what: &'static str) {
    let _ = std::thread::Builder::new()
        .name("watchdog".into())
        .spawn(move || {
            std::thread::sleep(after);
            eprintln!("rpc-bench {what}: time limit of {after:?} reached, exiting");
            std::process::exit(3);
        });
}

/// A running benchmark server process and its control pipes.
pub(crate) struct ServerProc {
    child: Child,
    input: ChildStdin,
    output: BufReader<ChildStdout>,
}

impl ServerProc {
    /// Starts `rpc-bench server` with `args`, bound to `bind_ip`; returns it and its data port.
    pub(crate) fn start(args: &[String], bind_ip: std::net::IpAddr) -> Result<(ServerProc, u16)> {
        let exe = std::env::current_exe().context("locate the rpc-bench executable")?;
        let mut child = Command::new(exe)
            .arg("server")
            .args(args)
            .arg("--bind")
            .arg(SocketAddr::new(bind_ip, 0).to_string())
            .arg("--die-with-parent")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawn the server process")?;
        let (Some(input), Some(output)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            bail!("server process has no pipes");
        };
        let mut p = ServerProc {
            child,
            input,
            output: BufReader::new(output),
        };
        let line = p.read_line()?;
        match line.strip_prefix("READY ") {
            Some(port) => {
                let port = port
                    .trim()
                    .parse()
                    .context("server process sent a bad port")?;
                Ok((p, port))
            }
            None => bail!("server process failed to start: {line}"),
        }
    }

    fn read_line(&mut self) -> Result<String> {
        let mut line = String::new();
        let n = self.output.read_line(&mut line)?;
        if n == 0 {
            let status = self.child.try_wait().ok().flatten();
            bail!("server process ended (status {status:?}); see its messages above");
        }
        Ok(line.trim_end().to_string())
    }

    fn ask(&mut self, cmd: &str) -> Result<String> {
        writeln!(self.input, "{cmd}")?;
        self.input.flush()?;
        self.read_line()
    }

    /// The server process's id.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Asks the server process to quit; kills it after a grace period.
    pub(crate) fn stop(mut self) {
        let _ = writeln!(self.input, "QUIT");
        let _ = self.input.flush();
        let deadline = Instant::now() + STOP_GRACE;
        loop {
            match self.child.try_wait() {
                Ok(Some(_)) => return,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return;
                }
            }
        }
    }
}

fn session(stream: TcpStream, local: SocketAddr) -> Result<()> {
    stream.set_nodelay(true)?;
    let mut out = stream.try_clone()?;
    let input = BufReader::new(stream);
    let mut server: Option<ServerProc> = None;
    let result = (|| -> Result<()> {
        for line in input.lines() {
            let line = line?;
            let mut words = line.split_whitespace();
            let answer = match words.next() {
                Some("START") => {
                    if let Some(s) = server.take() {
                        s.stop();
                    }
                    let args: Vec<String> = words.map(str::to_string).collect();
                    match ServerProc::start(&args, local.ip()) {
                        Ok((p, port)) => {
                            server = Some(p);
                            format!("READY {port}")
                        }
                        Err(e) => format!("ERR {e:#}"),
                    }
                }
                Some("CPU") => match server.as_mut() {
                    Some(s) => s.ask("CPU").unwrap_or_else(|e| format!("ERR {e:#}")),
                    None => "ERR no server running".to_string(),
                },
                Some("STOP") => {
                    if let Some(s) = server.take() {
                        s.stop();
                    }
                    "STOPPED".to_string()
                }
                Some("INFO") => format!("INFO {}", Machine::this().describe()),
                Some("BYE") => return Ok(()),
                _ => format!("ERR unknown command {line:?}"),
            };
            writeln!(out, "{}", answer.replace('\n', " "))?;
            out.flush()?;
        }
        Ok(())
    })();
    if let Some(s) = server.take() {
        s.stop();
    }
    result
}

/// The runner's handle on a supervisor: a local child process, or a remote `serve`.
#[derive(Debug)]
pub struct Remote {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
    host: std::net::IpAddr,
    local: Option<Child>,
}

impl Remote {
    /// Starts a supervisor child on loopback and connects to it.
    ///
    /// # Errors
    /// When it cannot be spawned or does not answer.
    pub fn spawn_local(max_secs: u64) -> Result<Remote> {
        let exe = std::env::current_exe().context("locate the rpc-bench executable")?;
        let mut child = Command::new(exe)
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--once",
                "--die-with-parent",
            ])
            .arg("--max-secs")
            .arg(max_secs.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("spawn `rpc-bench serve`")?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| anyhow!("supervisor has no stdout"))?;
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line)?;
        let addr = match line.trim().strip_prefix("LISTEN ") {
            Some(a) => a.to_string(),
            None => {
                let _ = child.kill();
                let _ = child.wait();
                bail!("`rpc-bench serve` did not start: {line:?}");
            }
        };
        let mut r = Remote::connect(&addr)?;
        r.local = Some(child);
        Ok(r)
    }

    /// Connects to a supervisor at `addr` (`host:port`).
    ///
    /// # Errors
    /// When the address does not resolve or nobody listens there.
    pub fn connect(addr: &str) -> Result<Remote> {
        let sa = addr
            .to_socket_addrs()
            .with_context(|| format!("resolve {addr}"))?
            .next()
            .ok_or_else(|| anyhow!("{addr} resolves to nothing"))?;
        let stream = TcpStream::connect_timeout(&sa, Duration::from_secs(10))
            .with_context(|| format!("connect to `rpc-bench serve` at {addr}"))?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(ANSWER_TIMEOUT))?;
        Ok(Remote {
            writer: stream.try_clone()?,
            reader: BufReader::new(stream),
            host: sa.ip(),
            local: None,
        })
    }

    fn ask(&mut self, cmd: &str) -> Result<String> {
        writeln!(self.writer, "{cmd}")?;
        self.writer.flush()?;
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .with_context(|| format!("waiting for the answer to {cmd:?}"))?;
        if n == 0 {
            bail!("`rpc-bench serve` closed the control connection");
        }
        let line = line.trim_end().to_string();
        if let Some(e) = line.strip_prefix("ERR ") {
            bail!("server host: {e}");
        }
        Ok(line)
    }

    /// Starts a server process with `args` (of `rpc-bench server`); returns its data address.
    ///
    /// # Errors
    /// When it fails to start (the server host's message is included).
    pub fn start(&mut self, args: &[String]) -> Result<SocketAddr> {
        if args.iter().any(|a| a.contains(char::is_whitespace)) {
            bail!("server arguments may not contain spaces: {args:?}");
        }
        let line = self.ask(&format!("START {}", args.join(" ")))?;
        let port: u16 = line
            .strip_prefix("READY ")
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| anyhow!("unexpected answer to START: {line:?}"))?;
        Ok(SocketAddr::new(self.host, port))
    }

    /// CPU time and soft RNIC counters (bytes copied, work requests) of the running server
    /// process.
    ///
    /// # Errors
    /// When no server runs or the answer is malformed.
    pub fn server_usage(&mut self) -> Result<(CpuTime, (u64, u64))> {
        let line = self.ask("CPU")?;
        parse_cpu(&line).ok_or_else(|| anyhow!("bad CPU answer {line:?}"))
    }

    /// Stops the running server process.
    ///
    /// # Errors
    /// When the supervisor does not answer.
    pub fn stop(&mut self) -> Result<()> {
        self.ask("STOP").map(|_| ())
    }

    /// The server host's machine description.
    ///
    /// # Errors
    /// When the supervisor does not answer.
    pub fn info(&mut self) -> Result<String> {
        let line = self.ask("INFO")?;
        Ok(line.strip_prefix("INFO ").unwrap_or(&line).to_string())
    }

    /// Whether the supervisor is a child of this process (one-host mode).
    pub fn is_local(&self) -> bool {
        self.local.is_some()
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let _ = writeln!(self.writer, "BYE");
        let _ = self.writer.flush();
        let _ = self.writer.shutdown(std::net::Shutdown::Both);
        if let Some(mut child) = self.local.take() {
            let deadline = Instant::now() + STOP_GRACE;
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// `CPU <user ns> <sys ns> <nic bytes> <nic ops>` -> the times and counters.
pub fn parse_cpu(line: &str) -> Option<(CpuTime, (u64, u64))> {
    let mut w = line.strip_prefix("CPU ")?.split_whitespace();
    let mut next = || w.next()?.parse::<u64>().ok();
    let (user, sys, bytes, ops) = (next()?, next()?, next()?, next()?);
    Some((CpuTime::from_nanos(user, sys), (bytes, ops)))
}

/// The `CPU` answer for `t` and the soft RNIC counters `nic`.
pub fn format_cpu(t: CpuTime, nic: (u64, u64)) -> String {
    let (u, s) = t.to_nanos();
    format!("CPU {u} {s} {} {}", nic.0, nic.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lines_round_trip() {
        let t = CpuTime::from_nanos(123_456_789, 42);
        assert_eq!(parse_cpu(&format_cpu(t, (7, 8))), Some((t, (7, 8))));
        assert_eq!(parse_cpu("CPU 1 2 3"), None);
        assert_eq!(parse_cpu("CPU 1"), None);
        assert_eq!(parse_cpu("CPU x 2"), None);
        assert_eq!(parse_cpu("READY 5"), None);
    }
}
