//! Trace context across calls, in W3C Trace Context's shape (`traceparent` metadata).
//!
//! A server reads the `traceparent` of each request (a malformed one is ignored, as the W3C
//! recommendation says), gives the call a span of its own in the same trace, and makes that
//! context current while the handler runs: [`TraceContext::current`] reads it, and calls the
//! handler makes through any [`crate::Channel`] carry it on (`traceparent` with the trace's id
//! and the handler's span as parent), so one trace follows a request from frontend to
//! backends. The server also opens a `tracing` span `rpc.server` per call (target
//! `rpc_core::call`, level DEBUG, fields `method`, `trace_id`, `span_id`, `parent_id`) entered
//! whenever the handler runs: a subscriber or an OpenTelemetry bridge picks them up.
//!
//! Free when unused: a request without `traceparent` costs one metadata lookup, a call made
//! outside a traced handler one thread-local read; no allocation unless a context is carried.
//! A caller starts a trace with [`TraceContext::new_root`] and [`TraceContext::inject`].

use std::cell::Cell;
use std::fmt::Write as _;

use crate::Metadata;

/// The metadata key of the trace context.
pub const TRACEPARENT: &str = "traceparent";

/// A position in a trace: the trace's id, the current span's id, and whether it is sampled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TraceContext {
    trace_id: u128,
    span_id: u64,
    sampled: bool,
}

thread_local! {
    static CURRENT: Cell<Option<TraceContext>> = const { Cell::new(None) };
    static RNG: Cell<u64> = const { Cell::new(0) };
}

/// A random non-zero number (xorshift64*, seeded per thread from the clock and the thread).
fn random() -> u64 {
    RNG.with(|r| {
        let mut x = r.get();
        if x == 0 {
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let local = 0u8;
            x = t ^ (&raw const local as u64).rotate_left(32) ^ 0x9e37_79b9_7f4a_7c15;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        r.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d).max(1)
    })
}

impl TraceContext {
    /// A new trace (random ids), sampled or not.
    pub fn new_root(sampled: bool) -> TraceContext {
        TraceContext {
            trace_id: (u128::from(random()) << 64) | u128::from(random()),
            span_id: random(),
            sampled,
        }
    }

    /// A new span in the same trace, a child of this one.
    pub fn child(&self) -> TraceContext {
        TraceContext {
            span_id: random(),
            ..*self
        }
    }

    /// The trace's 128-bit id (never 0).
    pub fn trace_id(&self) -> u128 {
        self.trace_id
    }

    /// The span's 64-bit id (never 0).
    pub fn span_id(&self) -> u64 {
        self.span_id
    }

    /// Whether the trace is sampled (the `sampled` flag).
    pub fn sampled(&self) -> bool {
        self.sampled
    }

    /// Parses a `traceparent` value: `00-<32 hex>-<16 hex>-<2 hex>`, lowercase; a later
    /// version is read by its first four fields, as the recommendation says. `None` for
    /// anything else, all-zero ids and version `ff`.
    pub fn parse(s: &str) -> Option<TraceContext> {
        let b = s.as_bytes();
        if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return None;
        }
        let hex = |r: std::ops::Range<usize>| -> Option<u128> {
            let part = &b[r];
            if !part
                .iter()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
            {
                return None;
            }
            u128::from_str_radix(std::str::from_utf8(part).ok()?, 16).ok()
        };
        let version = hex(0..2)?;
        if version == 0xff
            || (version == 0 && b.len() != 55)
            || (version > 0 && b.len() > 55 && b[55] != b'-')
        {
            return None;
        }
        let trace_id = hex(3..35)?;
        let span_id = u64::try_from(hex(36..52)?).ok()?;
        let flags = hex(53..55)?;
        if trace_id == 0 || span_id == 0 {
            return None;
        }
        Some(TraceContext {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
        })
    }

    /// The context in `metadata`'s `traceparent`, if it has a valid one.
    pub fn from_metadata(metadata: &Metadata) -> Option<TraceContext> {
        TraceContext::parse(metadata.get_str(TRACEPARENT)?)
    }

    /// Sets `traceparent` in `metadata` to this context.
    pub fn inject(&self, metadata: &mut Metadata) {
        // A `traceparent` is always a valid ASCII value.
        let _ = metadata.insert(TRACEPARENT, self.to_string());
    }

    /// The context of the traced handler this thread runs now, if any.
    pub fn current() -> Option<TraceContext> {
        CURRENT.with(Cell::get)
    }

    /// Runs `f` with this context current (calls it makes carry it on).
    pub fn scope<R>(self, f: impl FnOnce() -> R) -> R {
        let _g = enter(Some(self));
        f()
    }
}

impl std::fmt::Display for TraceContext {
    /// The `traceparent` value (version 00).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id,
            self.span_id,
            u8::from(self.sampled)
        )
    }
}

/// Makes `ctx` current until dropped (the previous one comes back).
pub(crate) struct Entered {
    prev: Option<TraceContext>,
    set: bool,
}

impl Drop for Entered {
    fn drop(&mut self) {
        if self.set {
            CURRENT.with(|c| c.set(self.prev));
        }
    }
}

/// Makes `ctx` current (when it is `Some`) until the guard drops.
pub(crate) fn enter(ctx: Option<TraceContext>) -> Entered {
    match ctx {
        None => Entered {
            prev: None,
            set: false,
        },
        Some(ctx) => Entered {
            prev: CURRENT.with(|c| c.replace(Some(ctx))),
            set: true,
        },
    }
}

/// A call about to be sent: when this thread runs a traced handler and the request carries no
/// `traceparent` of its own, it gets the handler's trace with a new span of its own.
pub(crate) fn carry(metadata: &mut Metadata) {
    if let Some(ctx) = TraceContext::current()
        && metadata.get(TRACEPARENT).is_none()
    {
        ctx.child().inject(metadata);
    }
}

/// The server's span of a call to `path` in trace context `ctx` (its own span, child of the
/// caller's `parent`).
pub(crate) fn server_span(path: &str, ctx: &TraceContext, parent: &TraceContext) -> tracing::Span {
    let span = tracing::debug_span!(target: "rpc_core::call", "rpc.server", method = path, trace_id = tracing::field::Empty, span_id = tracing::field::Empty, parent_id = tracing::field::Empty);
    if !span.is_disabled() {
        let mut s = String::with_capacity(32);
        let _ = write!(s, "{:032x}", ctx.trace_id);
        span.record("trace_id", s.as_str());
        span.record("span_id", format!("{:016x}", ctx.span_id).as_str());
        span.record("parent_id", format!("{:016x}", parent.span_id).as_str());
    }
    span
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_round_trips_and_bad_ones_are_ignored() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let c = TraceContext::parse(s).unwrap();
        assert_eq!(c.trace_id(), 0x4bf9_2f35_77b3_4da6_a3ce_929d_0e0e_4736);
        assert_eq!(c.span_id(), 0x00f0_67aa_0ba9_02b7);
        assert!(c.sampled());
        assert_eq!(c.to_string(), s);
        // A later version with more fields: its first four are read.
        assert!(TraceContext::parse(&format!("cc{}-what-ever", &s[2..])).is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0é",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_child_keeps_the_trace_and_the_scope_is_restored() {
        let root = TraceContext::new_root(true);
        let child = root.child();
        assert_eq!(child.trace_id(), root.trace_id());
        assert_ne!(child.span_id(), root.span_id());
        assert_eq!(TraceContext::current(), None);
        root.scope(|| {
            assert_eq!(TraceContext::current(), Some(root));
            child.scope(|| assert_eq!(TraceContext::current(), Some(child)));
            assert_eq!(TraceContext::current(), Some(root));
            let mut md = Metadata::new();
            carry(&mut md);
            let sent = TraceContext::from_metadata(&md).unwrap();
            assert_eq!(sent.trace_id(), root.trace_id());
            assert_ne!(sent.span_id(), root.span_id());
        });
        assert_eq!(TraceContext::current(), None);
        let mut md = Metadata::new();
        carry(&mut md);
        assert!(md.is_empty(), "nothing carried outside a traced handler");
    }
}
