//! Keepalive of the bootstrap TCP connection, the liveness channel of an RDMA connection.
//!
//! After the handshake nothing is written on that connection until one side closes it, and an
//! idle connection notices no dead link or vanished host by itself: a client whose requests
//! were delivered, waiting for long handlers, and a server holding a client's connection would
//! wait forever. The kernel's TCP keepalive probes the peer instead: after `interval` of
//! silence it sends a probe (an ACK the peer's kernel answers, no byte for either process),
//! and while none is answered it keeps probing; after `interval + timeout` without an answer
//! (`TCP_USER_TIMEOUT`, which also bounds unacknowledged data such as a closing refusal) the
//! socket fails with `ETIMEDOUT` (or the network error seen meanwhile), and the code that
//! turns an ended bootstrap connection into a closed RDMA connection does the rest: calls in
//! flight end `UNAVAILABLE` naming keepalive, the server frees the connection.
//!
//! What it sees: the path between the two hosts' TCP stacks and the hosts themselves (link
//! down for good, a host powered off or partitioned away). What it does not: a process that
//! is alive but stuck (its kernel still answers; deadlines are for that), and an RDMA path
//! that differs from the TCP one (a separate fabric): there RC reports the broken path when
//! either side next posts, after its retries.

use std::io;
use std::os::fd::AsFd;
use std::time::Duration;

/// How the bootstrap TCP connection of an RDMA connection is probed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct KeepAlive {
    /// Silence before the first probe, and between answered probes.
    pub(crate) interval: Duration,
    /// How long probes (or data) may go unanswered before the connection is declared dead.
    pub(crate) timeout: Duration,
}

/// The default `interval`: the first probe after 10 s of silence.
pub(crate) const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
/// The default `timeout`: a peer that answers no probe for 20 s is gone (tonic's default
/// `keep_alive_timeout`).
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(20);

/// Probes sent within `timeout` (at least one a second), so that one lost probe is no
/// failure.
const PROBES: u64 = 3;
/// Linux's largest `TCP_KEEPIDLE` and `TCP_KEEPINTVL` (`MAX_TCP_KEEPIDLE`, seconds).
const MAX_SECS: u64 = 32_767;
/// Linux's largest `TCP_KEEPCNT` (`MAX_TCP_KEEPCNT`).
const MAX_PROBES: u64 = 127;

const _: () = assert!(PROBES >= 1 && PROBES <= MAX_PROBES);
const _: () = assert!(DEFAULT_INTERVAL.as_secs() + DEFAULT_TIMEOUT.as_secs() <= 60);

impl KeepAlive {
    /// The builders' options: no keepalive when `interval` is `None`.
    pub(crate) fn from_options(interval: Option<Duration>, timeout: Duration) -> Option<Self> {
        interval.map(|interval| KeepAlive { interval, timeout })
    }

    /// `TCP_KEEPIDLE`: whole seconds, at least one.
    fn idle_secs(&self) -> u64 {
        ceil_secs(self.interval).clamp(1, MAX_SECS)
    }

    /// `TCP_KEEPINTVL`: the timeout split over [`PROBES`] probes, whole seconds, at least one.
    fn probe_secs(&self) -> u64 {
        ceil_secs(self.timeout).div_ceil(PROBES).clamp(1, MAX_SECS)
    }

    /// `TCP_KEEPCNT`: enough probes to cover the timeout.
    fn probes(&self) -> u64 {
        ceil_secs(self.timeout)
            .div_ceil(self.probe_secs())
            .clamp(1, MAX_PROBES)
    }

    /// `TCP_USER_TIMEOUT`: the silence (since the peer last answered) after which the kernel
    /// fails the connection.
    fn user_timeout_ms(&self) -> u32 {
        let secs = self.idle_secs() + self.probes() * self.probe_secs();
        // The kernel takes an `int`.
        secs.saturating_mul(1000).min(i32::MAX as u64) as u32
    }

    /// The longest a dead peer goes unnoticed: from its last answer to the failed socket
    /// (the first probe after `interval`, the last one `timeout` later, in whole seconds).
    pub(crate) fn bound(&self) -> Duration {
        Duration::from_millis(u64::from(self.user_timeout_ms()))
    }

    /// Turns keepalive on for `socket` with these settings.
    ///
    /// # Errors
    /// The failing `setsockopt`, named.
    pub(crate) fn apply(&self, socket: impl AsFd) -> io::Result<()> {
        use rustix::net::sockopt;
        let fd = socket.as_fd();
        let named = |what: &'static str| {
            move |e: rustix::io::Errno| io::Error::other(format!("setsockopt({what}): {e}"))
        };
        sockopt::set_tcp_keepidle(fd, Duration::from_secs(self.idle_secs()))
            .map_err(named("TCP_KEEPIDLE"))?;
        sockopt::set_tcp_keepintvl(fd, Duration::from_secs(self.probe_secs()))
            .map_err(named("TCP_KEEPINTVL"))?;
        sockopt::set_tcp_keepcnt(fd, self.probes() as u32).map_err(named("TCP_KEEPCNT"))?;
        sockopt::set_tcp_user_timeout(fd, self.user_timeout_ms())
            .map_err(named("TCP_USER_TIMEOUT"))?;
        sockopt::set_socket_keepalive(fd, true).map_err(named("SO_KEEPALIVE"))
    }
}

/// Whole seconds, rounded up.
fn ceil_secs(d: Duration) -> u64 {
    d.as_secs().saturating_add(u64::from(d.subsec_nanos() > 0))
}

/// Why a bootstrap connection ended, for the status of the calls it takes down and the log:
/// `peer` is "server" or "client", `error` what the read ended with (`None`: the peer closed
/// it), `keepalive` the probing the connection had.
pub(crate) fn why_ended(
    peer: &str,
    error: Option<&io::Error>,
    keepalive: Option<KeepAlive>,
) -> String {
    let Some(e) = error else {
        return format!("{peer} closed the connection");
    };
    if e.kind() == io::ErrorKind::UnexpectedEof {
        return format!("{peer} closed the connection");
    }
    let silent = matches!(
        e.kind(),
        io::ErrorKind::TimedOut
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
            | io::ErrorKind::NetworkDown
    );
    match keepalive {
        Some(k) if silent => format!(
            "keepalive: the {peer} did not answer for {} s (link down or host gone): {e}",
            k.bound().as_secs()
        ),
        _ if e.kind() == io::ErrorKind::ConnectionReset => {
            format!("{peer} reset the connection: {e}")
        }
        _ => format!("the connection to the {peer} failed: {e}"),
    }
}

/// The I/O error under a bootstrap error (`connect::recv_closing`'s), if any.
pub(crate) fn io_source(e: &crate::Error) -> Option<&io::Error> {
    e.cause().and_then(|s| s.downcast_ref::<io::Error>())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::net::sockopt;

    fn ka(interval: u64, timeout_ms: u64) -> KeepAlive {
        KeepAlive {
            interval: Duration::from_secs(interval),
            timeout: Duration::from_millis(timeout_ms),
        }
    }

    #[test]
    fn settings_cover_the_timeout_in_whole_seconds() {
        // (interval s, timeout ms) -> (idle, probe interval, probes, bound s)
        for ((i, t), (idle, intvl, n, bound)) in [
            ((10, 20_000), (10, 7, 3, 31)),
            ((1, 2_000), (1, 1, 2, 3)),
            ((1, 3_000), (1, 1, 3, 4)),
            ((2, 500), (2, 1, 1, 3)),
            ((0, 0), (1, 1, 1, 2)),
            ((30, 60_000), (30, 20, 3, 90)),
        ] {
            let k = ka(i, t);
            assert_eq!(
                (
                    k.idle_secs(),
                    k.probe_secs(),
                    k.probes(),
                    k.bound().as_secs()
                ),
                (idle, intvl, n, bound),
                "{k:?}"
            );
            // The probes cover the timeout asked for.
            assert!(k.probes() * k.probe_secs() * 1000 >= t, "{k:?}");
        }
        // The defaults: a dead peer is noticed within 31 s of its last answer.
        let default = KeepAlive::from_options(Some(DEFAULT_INTERVAL), DEFAULT_TIMEOUT);
        assert_eq!(default.map(|k| k.bound()), Some(Duration::from_secs(31)));
        let huge = KeepAlive {
            interval: Duration::from_secs(u64::MAX),
            timeout: Duration::from_secs(u64::MAX),
        };
        assert_eq!(huge.idle_secs(), MAX_SECS);
        assert!(huge.probes() <= MAX_PROBES);
        assert_eq!(huge.user_timeout_ms(), i32::MAX as u32);
        assert_eq!(ceil_secs(Duration::MAX), u64::MAX);
    }

    #[test]
    fn options_map_to_socket_options() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(!sockopt::socket_keepalive(&s).unwrap());
        let k = ka(2, 5_000);
        k.apply(&s).unwrap();
        assert!(sockopt::socket_keepalive(&s).unwrap());
        assert_eq!(sockopt::tcp_keepidle(&s).unwrap(), Duration::from_secs(2));
        assert_eq!(sockopt::tcp_keepintvl(&s).unwrap(), Duration::from_secs(2));
        assert_eq!(sockopt::tcp_keepcnt(&s).unwrap(), 3);
        assert_eq!(sockopt::tcp_user_timeout(&s).unwrap(), 8_000);
        assert_eq!(KeepAlive::from_options(None, DEFAULT_TIMEOUT), None);
    }

    #[test]
    fn ends_name_their_cause() {
        let k = Some(ka(1, 2_000));
        let timed_out = io::Error::from(io::ErrorKind::TimedOut);
        let m = why_ended("server", Some(&timed_out), k);
        assert!(
            m.starts_with("keepalive: the server did not answer for 3 s (link down or host gone)"),
            "{m}"
        );
        let unreachable = io::Error::from_raw_os_error(libc::EHOSTUNREACH);
        assert!(why_ended("client", Some(&unreachable), k).starts_with("keepalive: the client"));
        let eof = io::Error::from(io::ErrorKind::UnexpectedEof);
        assert_eq!(
            why_ended("server", Some(&eof), k),
            "server closed the connection"
        );
        assert_eq!(why_ended("server", None, k), "server closed the connection");
        let reset = io::Error::from_raw_os_error(libc::ECONNRESET);
        assert!(why_ended("server", Some(&reset), k).starts_with("server reset the connection"));
        // Without keepalive a timeout is only a failed connection.
        let m = why_ended("server", Some(&timed_out), None);
        assert!(m.starts_with("the connection to the server failed"), "{m}");
        let wrapped =
            crate::Error::with_source(crate::TransportErrorKind::Io, "reading", timed_out);
        assert_eq!(
            io_source(&wrapped).map(io::Error::kind),
            Some(io::ErrorKind::TimedOut)
        );
    }
}
