//! Streaming measurements (issue 7), written once for every system that streams (rdma-rpc and
//! tonic) over the calls of `bench.proto`:
//!
//! - **ping-pong**: one `EchoBidi` call; the client sends one message and waits for its reply
//!   before sending the next. Each round trip is timed (HdrHistogram), like the unary latency
//!   phase, but without a call's setup and teardown per message.
//! - **server streaming**: `EchoStream` calls of [`messages_per_call`] messages of `size` bytes,
//!   one after another, each read to its end; messages/s and goodput (payload one way).
//! - **bidi pipelining**: one `EchoBidi` call with `in_flight` messages outstanding: every reply
//!   received lets one more request go; messages/s and goodput (request + reply payload).
//!
//! Every phase is bounded in time: a stalled call fails the phase with an error instead of
//! hanging the run. Each call ends cleanly (the client half-closes, the server ends the stream
//! with OK) and the harness checks that it did.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use bytes::Bytes;
use tokio::runtime::Runtime;
use tokio::sync::mpsc;

use crate::client::{self, Probe};
use crate::measure::{self, CpuDelta, LatencyRun, Plan};
use crate::proto::EchoRequest;

/// The sizes of issue 7.
pub const DEFAULT_STREAM_SIZES: [usize; 4] = [32, 4 << 10, 64 << 10, 1 << 20];
/// Messages in flight on the pipelined bidi call, unless the command line says otherwise.
pub const DEFAULT_PIPELINE: usize = 8;
/// A server-streaming call carries about this many payload bytes...
pub const CALL_BYTES: usize = 32 << 20;
/// ...in at most this many messages...
pub const CALL_MAX_MESSAGES: usize = 4096;
/// ...and at least this many.
pub const CALL_MIN_MESSAGES: usize = 4;

const _: () = assert!(CALL_MIN_MESSAGES <= CALL_MAX_MESSAGES);
const _: () = assert!(CALL_MAX_MESSAGES <= u32::MAX as usize);

/// Messages per server-streaming call for `size`-byte messages: [`CALL_BYTES`] worth, within
/// [`CALL_MIN_MESSAGES`]..=[`CALL_MAX_MESSAGES`], so the call's own start and end cost little
/// against its messages at every size.
pub fn messages_per_call(size: usize) -> u32 {
    // In range by the clamp and the assertion above.
    (CALL_BYTES / size.max(1)).clamp(CALL_MIN_MESSAGES, CALL_MAX_MESSAGES) as u32
}

/// One timed throughput phase of a stream.
#[derive(Debug)]
pub struct StreamRun {
    /// Messages received (replies).
    pub messages: u64,
    /// Calls the messages came on.
    pub calls: u64,
    /// Wall time of the timed phase.
    pub wall: Duration,
    /// CPU time over the timed phase.
    pub cpu: CpuDelta,
}

/// What the runner asks of a system that streams.
pub trait StreamClient {
    /// Warms up, then times `size`-byte round trips on one bidi call, one message at a time.
    ///
    /// # Errors
    /// When the call fails, a reply has the wrong size, or the call stalls.
    fn ping_pong(&mut self, size: usize, plan: &Plan, probe: &mut dyn Probe) -> Result<LatencyRun>;

    /// Warms up, then counts `size`-byte messages of server-streaming calls.
    ///
    /// # Errors
    /// As [`StreamClient::ping_pong`], or when a stream ends early.
    fn server_stream(
        &mut self,
        size: usize,
        plan: &Plan,
        probe: &mut dyn Probe,
    ) -> Result<StreamRun>;

    /// Warms up, then counts `size`-byte replies on one bidi call with `in_flight` messages
    /// outstanding.
    ///
    /// # Errors
    /// As [`StreamClient::ping_pong`].
    fn bidi(
        &mut self,
        size: usize,
        in_flight: usize,
        plan: &Plan,
        probe: &mut dyn Probe,
    ) -> Result<StreamRun>;
}

/// The request stream of a bidi call, fed through a channel: the sender's end is the
/// client's; dropping it half-closes the call.
#[derive(Debug)]
pub struct Outbox(mpsc::Receiver<EchoRequest>);

impl futures_core::Stream for Outbox {
    type Item = EchoRequest;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<EchoRequest>> {
        self.get_mut().0.poll_recv(cx)
    }
}

/// A request stream holding up to `depth` unsent messages, and its sender.
pub fn outbox(depth: usize) -> (mpsc::Sender<EchoRequest>, Outbox) {
    let (tx, rx) = mpsc::channel(depth.max(1));
    (tx, Outbox(rx))
}

/// The replies of one streaming call, as each framework delivers them.
pub trait Replies {
    /// The payload length of the next reply; `None` when the call ended with OK.
    ///
    /// # Errors
    /// The call's error status (named with the framework), or a reply that does not decode.
    fn next_len(&mut self) -> impl Future<Output = Result<Option<usize>>>;
}

/// One framework's streaming calls (implemented by the rdma-rpc and tonic clients); the
/// measurements themselves are shared ([`StreamClient`] for every `StreamSystem`).
pub trait StreamSystem {
    /// The replies of a call.
    type Replies: Replies;

    /// The runtime the calls run on (`block_on` from the client thread).
    fn runtime(&self) -> &Runtime;

    /// How long one message or call may take before the phase counts as stalled.
    fn call_timeout(&self) -> Duration;

    /// Opens an `EchoBidi` call sending `requests`, with a deadline of `limit` over the whole
    /// call.
    fn open_bidi(
        &self,
        requests: Outbox,
        limit: Duration,
    ) -> impl Future<Output = Result<Self::Replies>>;

    /// Opens an `EchoStream` call for `count` messages of `size` bytes, with a deadline of
    /// `limit`.
    fn open_stream(
        &self,
        count: u32,
        size: u32,
        limit: Duration,
    ) -> impl Future<Output = Result<Self::Replies>>;
}

/// `fut`, failed with an error naming `what` when it takes longer than `limit`.
async fn bounded<T>(
    limit: Duration,
    what: &str,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    match tokio::time::timeout(limit, fut).await {
        Ok(r) => r,
        Err(_) => bail!("{what}: no end after {limit:?} (stalled?)"),
    }
}

/// Sends one message and waits for its reply.
async fn exchange<R: Replies>(
    tx: &mpsc::Sender<EchoRequest>,
    replies: &mut R,
    payload: &Bytes,
) -> Result<()> {
    send(tx, payload).await?;
    reply(replies, payload.len()).await
}

async fn send(tx: &mpsc::Sender<EchoRequest>, payload: &Bytes) -> Result<()> {
    tx.send(EchoRequest {
        payload: payload.clone(),
        reply_size: 0,
    })
    .await
    .map_err(|_| anyhow!("the call stopped taking request messages"))
}

async fn reply<R: Replies>(replies: &mut R, size: usize) -> Result<()> {
    match replies.next_len().await? {
        Some(n) if n == size => Ok(()),
        Some(n) => bail!("a reply of {n} bytes to a message of {size} bytes"),
        None => bail!("the call ended with OK while a reply of {size} bytes was due"),
    }
}

/// Waits for a call whose requests are half-closed to end with OK and nothing more.
async fn end<R: Replies>(replies: &mut R) -> Result<()> {
    match replies.next_len().await? {
        None => Ok(()),
        Some(n) => bail!("an unasked-for reply of {n} bytes after the last one"),
    }
}

/// Reads one server stream to its end; returns its messages.
async fn drain<R: Replies>(mut replies: R, count: u32, size: usize) -> Result<u64> {
    let mut n = 0u64;
    while let Some(len) = replies.next_len().await? {
        if len != size {
            bail!("stream message {n} has {len} bytes, not {size}");
        }
        n += 1;
    }
    if n != u64::from(count) {
        bail!("the stream ended with OK after {n} of {count} messages");
    }
    Ok(n)
}

/// Keeps `in_flight` messages outstanding on a bidi call until `stop(start, replies)` says so,
/// then takes the replies still due (uncounted). Returns the replies counted and when the stop
/// came.
async fn pipelined<R: Replies>(
    tx: &mpsc::Sender<EchoRequest>,
    replies: &mut R,
    payload: &Bytes,
    in_flight: usize,
    stop: impl Fn(Instant, u64) -> bool,
) -> Result<(u64, Duration)> {
    let start = Instant::now();
    for _ in 0..in_flight {
        send(tx, payload).await?;
    }
    let mut outstanding = in_flight;
    let mut counted = 0u64;
    let mut stopped_at = None;
    while outstanding > 0 {
        reply(replies, payload.len()).await?;
        outstanding -= 1;
        if stopped_at.is_some() {
            continue;
        }
        counted += 1;
        if stop(start, counted) {
            stopped_at = Some(start.elapsed());
        } else {
            send(tx, payload).await?;
            outstanding += 1;
        }
    }
    Ok((counted, stopped_at.unwrap_or_else(|| start.elapsed())))
}

/// Seconds a phase may take, by the plan, plus one stalled call: beyond it the phase fails.
fn phase_limit(plan: &Plan, call_timeout: Duration) -> Duration {
    plan.max_phase + call_timeout
}

impl<T: StreamSystem> StreamClient for T {
    fn ping_pong(&mut self, size: usize, plan: &Plan, probe: &mut dyn Probe) -> Result<LatencyRun> {
        let limit = phase_limit(plan, self.call_timeout());
        let rt = self.runtime();
        let payload = client::payload(size);
        let (tx, requests) = outbox(1);
        // Warm-up, timed phase and end on the one call.
        let mut replies = rt.block_on(bounded(
            limit,
            "open the bidi call",
            self.open_bidi(requests, 3 * limit),
        ))?;
        rt.block_on(bounded(limit, "ping-pong warm-up", async {
            let start = Instant::now();
            let mut n = 0;
            while !plan.warm(start, n) {
                exchange(&tx, &mut replies, &payload).await?;
                n += 1;
            }
            Ok(())
        }))?;
        let before = probe.snapshot()?;
        let (hist, calls, wall) = rt.block_on(bounded(limit, "ping-pong", async {
            let mut hist = measure::histogram();
            let start = Instant::now();
            let mut n = 0u64;
            while !plan.done(start, plan.latency, n) {
                let t0 = Instant::now();
                exchange(&tx, &mut replies, &payload).await?;
                measure::record(&mut hist, t0.elapsed());
                n += 1;
            }
            Ok((hist, n, start.elapsed()))
        }))?;
        let cpu = probe.snapshot()?.since(before);
        drop(tx);
        rt.block_on(bounded(limit, "end of the bidi call", end(&mut replies)))?;
        Ok(LatencyRun {
            hist,
            calls,
            wall,
            cpu,
        })
    }

    fn server_stream(
        &mut self,
        size: usize,
        plan: &Plan,
        probe: &mut dyn Probe,
    ) -> Result<StreamRun> {
        let timeout = self.call_timeout();
        let limit = phase_limit(plan, timeout);
        let count = messages_per_call(size);
        let size32 = u32::try_from(size).map_err(|_| anyhow!("{size} bytes is too large"))?;
        let one = || async {
            let replies = self.open_stream(count, size32, timeout).await?;
            drain(replies, count, size).await
        };
        let rt = self.runtime();
        rt.block_on(bounded(limit, "server-streaming warm-up", async {
            let start = Instant::now();
            let mut calls = 0;
            while !plan.warm(start, calls) {
                one().await?;
                calls += 1;
            }
            Ok(())
        }))?;
        let before = probe.snapshot()?;
        let (messages, calls, wall) = rt.block_on(bounded(limit, "server streaming", async {
            let start = Instant::now();
            let (mut messages, mut calls) = (0u64, 0u64);
            while !plan.done(start, plan.rate, messages) {
                messages += one().await?;
                calls += 1;
            }
            Ok((messages, calls, start.elapsed()))
        }))?;
        let cpu = probe.snapshot()?.since(before);
        Ok(StreamRun {
            messages,
            calls,
            wall,
            cpu,
        })
    }

    fn bidi(
        &mut self,
        size: usize,
        in_flight: usize,
        plan: &Plan,
        probe: &mut dyn Probe,
    ) -> Result<StreamRun> {
        let limit = phase_limit(plan, self.call_timeout());
        let rt = self.runtime();
        let payload = client::payload(size);
        let in_flight = in_flight.max(1);
        let (tx, requests) = outbox(in_flight);
        let mut replies = rt.block_on(bounded(
            limit,
            "open the bidi call",
            self.open_bidi(requests, 3 * limit),
        ))?;
        let p = *plan;
        rt.block_on(bounded(
            limit,
            "pipelined bidi warm-up",
            pipelined(&tx, &mut replies, &payload, in_flight, |t, n| p.warm(t, n)),
        ))?;
        let before = probe.snapshot()?;
        let (messages, wall) = rt.block_on(bounded(
            limit,
            "pipelined bidi",
            pipelined(&tx, &mut replies, &payload, in_flight, |t, n| {
                p.done(t, p.rate, n)
            }),
        ))?;
        let cpu = probe.snapshot()?.since(before);
        drop(tx);
        rt.block_on(bounded(limit, "end of the bidi call", end(&mut replies)))?;
        Ok(StreamRun {
            messages,
            calls: 1,
            wall,
            cpu,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    #[test]
    fn messages_per_call_stays_in_bounds() {
        assert_eq!(messages_per_call(32), CALL_MAX_MESSAGES as u32);
        assert_eq!(messages_per_call(64 << 10), 512);
        assert_eq!(messages_per_call(1 << 20), 32);
        assert_eq!(messages_per_call(16 << 20), CALL_MIN_MESSAGES as u32);
        assert_eq!(messages_per_call(0), CALL_MAX_MESSAGES as u32);
    }

    /// A peer that echoes what `Outbox` carries, through a channel, after yielding once.
    struct Echo {
        requests: Outbox,
        /// Replies the test wants changed: (index, length).
        bad: Option<(u64, usize)>,
        seen: u64,
        queued: VecDeque<usize>,
    }

    impl Replies for Echo {
        async fn next_len(&mut self) -> Result<Option<usize>> {
            tokio::task::yield_now().await;
            if let Some(n) = self.queued.pop_front() {
                return Ok(Some(n));
            }
            let Some(req) = std::future::poll_fn(|cx| {
                futures_core::Stream::poll_next(Pin::new(&mut self.requests), cx)
            })
            .await
            else {
                return Ok(None);
            };
            let i = self.seen;
            self.seen += 1;
            Ok(Some(match self.bad {
                Some((j, len)) if j == i => len,
                _ => req.payload.len(),
            }))
        }
    }

    fn rt() -> Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn pipelined_counts_until_the_rule_stops_it_and_takes_what_is_due() {
        let rt = rt();
        let (tx, requests) = outbox(4);
        let mut echo = Echo {
            requests,
            bad: None,
            seen: 0,
            queued: VecDeque::new(),
        };
        let payload = client::payload(100);
        let (n, _) = rt
            .block_on(pipelined(&tx, &mut echo, &payload, 4, |_, n| n >= 50))
            .unwrap();
        assert_eq!(n, 50);
        // 50 counted plus the 3 still due when the rule stopped it, nothing left over.
        assert_eq!(echo.seen, 53);
        drop(tx);
        rt.block_on(end(&mut echo)).unwrap();
    }

    #[test]
    fn a_reply_of_the_wrong_size_fails_the_phase() {
        let rt = rt();
        let (tx, requests) = outbox(1);
        let mut echo = Echo {
            requests,
            bad: Some((3, 7)),
            seen: 0,
            queued: VecDeque::new(),
        };
        let payload = client::payload(32);
        for _ in 0..3 {
            rt.block_on(exchange(&tx, &mut echo, &payload)).unwrap();
        }
        let e = rt.block_on(exchange(&tx, &mut echo, &payload)).unwrap_err();
        assert!(e.to_string().contains("7 bytes"), "{e}");
    }

    #[test]
    fn end_and_drain_check_the_message_counts() {
        let rt = rt();
        let (_tx, requests) = outbox(1);
        let mut extra = Echo {
            requests,
            bad: None,
            seen: 0,
            queued: VecDeque::from([5]),
        };
        let e = rt.block_on(end(&mut extra)).unwrap_err();
        assert!(e.to_string().contains("unasked-for"), "{e}");

        let (tx, requests) = outbox(1);
        drop(tx);
        let short = Echo {
            requests,
            bad: None,
            seen: 0,
            queued: VecDeque::from([8, 8]),
        };
        let e = rt.block_on(drain(short, 3, 8)).unwrap_err();
        assert!(e.to_string().contains("after 2 of 3"), "{e}");
    }

    #[test]
    fn a_stalled_phase_fails_with_its_name() {
        let rt = rt();
        let e = rt
            .block_on(bounded(
                Duration::from_millis(10),
                "ping-pong",
                std::future::pending::<Result<()>>(),
            ))
            .unwrap_err();
        assert!(e.to_string().starts_with("ping-pong: no end"), "{e}");
    }
}
