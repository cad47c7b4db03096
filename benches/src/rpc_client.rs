//! System (a): rdma-rpc, through the client generated from `bench.proto`.
//!
//! One outstanding call: blocking calls (`BenchBlockingClient::echo`) on a channel whose calling thread
//! polls the completion queue itself (`ClientPoller::Caller`): the lowest-latency path. Many
//! outstanding, by default: one [`rpc_core::Pipeline`] keeping `k` calls in flight from the
//! calling (only) thread, which also drives the connection (no tasks, no wakers); with
//! `AsyncMode::Caller`, `k` tasks on one current-thread tokio runtime sharing the channel,
//! still polled by that one thread; with `AsyncMode::Poller`, tasks on a two-worker runtime
//! with the process's poller thread.
//!
//! Streaming calls (issue 7) run on the caller-polled channel and its current-thread runtime:
//! the consumer of a stream drives the connection while it waits, the request pump is a task
//! on the same runtime, so one client thread does everything, as in the unary phases.
//!
//! Large payloads are built in registered memory from the channel (`Channel::alloc_bytes`,
//! once per size and channel, a `Bytes` clone per call): the API a performance user of
//! rdma-rpc would use (eRPC's and UCX's message buffers), so the client sends the request
//! without copying it. tonic has no equivalent; it serializes the payload as always.
//! `System::RpcPlain` is the same client with neither opt-in: payloads in ordinary memory and
//! no response size hint, what a user who reads no documentation gets.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;
use rpc_core::verbs::ProviderKind;
use rpc_core::{Channel, ClientPoller, RegisteredBytes, Request};

use crate::client::{self, BenchClient, MAX_OUTSTANDING, Probe, StopRule};
use crate::measure::{self, LatencyRun, Plan, RateRun};
use crate::proto::bench_client::{
    BenchBlockingClient, BenchClient as Generated, BenchPipelineClient,
};
use crate::proto::{EchoReply, EchoRequest, StreamRequest};
use crate::stream::{Outbox, Replies, StreamClient, StreamSystem};

/// How the many-outstanding phases drive calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AsyncMode {
    /// `Channel::pipeline`: one thread submits, drives the connection and collects responses
    /// (no async tasks).
    Pipeline,
    /// Tasks on one current-thread runtime; the same thread polls the CQ (one client thread).
    Caller,
    /// Tasks on a two-worker runtime; the process's poller thread polls the CQ.
    Poller,
}

/// A connected rdma-rpc client.
struct RpcClient {
    mode: AsyncMode,
    deadline: Option<Duration>,
    rt: tokio::runtime::Runtime,
    client: Generated,
    /// The same channel's blocking calls and pipelines.
    blocking: BenchBlockingClient,
    pipelines: BenchPipelineClient,
    /// For `AsyncMode::Poller`: its own runtime and channel.
    poller: Option<(tokio::runtime::Runtime, Generated)>,
    /// Registered payloads by size and channel (`true`: the poller's).
    regions: HashMap<(usize, bool), RegisteredBytes>,
    /// Use `alloc_bytes` and response size hints.
    opt_ins: bool,
    /// One outstanding: async calls from a task of the poller's runtime.
    async_latency: bool,
}

/// How to connect.
#[derive(Clone, Copy, Debug)]
pub struct Opts {
    /// The provider.
    pub provider: ProviderKind,
    /// How the many-outstanding phases drive calls.
    pub mode: AsyncMode,
    /// The timeout of every call.
    pub deadline: Option<Duration>,
    /// Build large payloads in registered memory (`Channel::alloc_bytes`) and give response
    /// size hints; false: default options only.
    pub opt_ins: bool,
    /// Time one-outstanding calls as async calls from a task on the `Poller` mode's runtime
    /// (with `mode` `Poller`), not as blocking calls.
    pub async_latency: bool,
}

/// Payloads at least this large are built in registered memory (smaller ones go eagerly,
/// copied into the send slot either way).
pub const REGISTERED_MIN: usize = 16 << 10;

/// A request payload: its bytes and, when they lie in registered memory, the region.
#[derive(Clone)]
struct Payload {
    bytes: Bytes,
    region: Option<RegisteredBytes>,
    /// Give the response size as a hint.
    hint: bool,
}

/// Connects to the rdma-rpc server at `addr`. Calls carry `opts.deadline` as their timeout.
///
/// # Errors
/// When the connection or handshake fails.
pub fn connect(addr: SocketAddr, opts: &Opts) -> Result<Box<dyn BenchClient>> {
    let Opts {
        provider,
        mode,
        deadline,
        opt_ins,
        async_latency,
    } = *opts;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = rt.block_on(open(addr, provider, ClientPoller::Caller))?;
    let poller = match mode {
        AsyncMode::Caller | AsyncMode::Pipeline => None,
        AsyncMode::Poller => {
            let prt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
            let c = prt.block_on(open(addr, provider, ClientPoller::Thread))?;
            Some((prt, c))
        }
    };
    Ok(Box::new(RpcClient {
        mode,
        deadline,
        rt,
        blocking: BenchBlockingClient::from(client.clone()),
        pipelines: BenchPipelineClient::from(client.clone()),
        client,
        poller,
        regions: HashMap::new(),
        opt_ins,
        async_latency,
    }))
}

async fn open(addr: SocketAddr, provider: ProviderKind, mode: ClientPoller) -> Result<Generated> {
    let ch = Channel::builder(addr.to_string())
        .provider(provider)
        .poller(mode)
        .max_concurrent_calls(MAX_OUTSTANDING as u32)
        .connect()
        .await
        .with_context(|| format!("rdma-rpc: connect to {addr}"))?;
    Ok(Generated::new(ch))
}

fn request(payload: &Payload, deadline: Option<Duration>) -> Request<EchoRequest> {
    let mut r = Request::new(EchoRequest {
        payload: payload.bytes.clone(),
        reply_size: 0,
    });
    if let Some(region) = &payload.region {
        // The payload lies in this registered memory: sent without a copy.
        r.set_registered(region);
    }
    if let Some(d) = deadline {
        r.set_timeout(d);
    }
    // Large replies land straight in a zone the client lends (one RDMA WRITE); the hint is
    // ignored below the eager threshold. Payload plus protobuf framing.
    if payload.hint {
        r.set_response_size_hint(payload.bytes.len() + 16);
    }
    r
}

fn check(size: usize, got: usize) -> Result<()> {
    if got != size {
        bail!("rdma-rpc: echo of {size} bytes came back with {got}");
    }
    Ok(())
}

async fn call_once(client: Generated, payload: Payload, deadline: Option<Duration>) -> Result<()> {
    let size = payload.bytes.len();
    let r = client
        .echo(request(&payload, deadline))
        .await
        .map_err(|s| anyhow::anyhow!("rdma-rpc: echo of {size} bytes: {s}"))?;
    check(size, r.get_ref().payload.len())
}

impl RpcClient {
    /// The payload of `size` bytes for the main channel, or the poller's (`poller`): in
    /// registered memory of that channel from `REGISTERED_MIN` on, allocated once.
    fn payload(&mut self, size: usize, poller: bool) -> Result<Payload> {
        let bytes = client::payload(size);
        if size < REGISTERED_MIN || !self.opt_ins {
            return Ok(Payload {
                bytes,
                region: None,
                hint: self.opt_ins,
            });
        }
        let (rt, ch) = match (&self.poller, poller) {
            (Some((rt, c)), true) => (rt, c.as_ref()),
            _ => (&self.rt, self.client.as_ref()),
        };
        let region = match self.regions.entry((size, poller)) {
            std::collections::hash_map::Entry::Occupied(e) => e.get().clone(),
            std::collections::hash_map::Entry::Vacant(v) => {
                let mut buf = rt
                    .block_on(ch.alloc_bytes(size))
                    .map_err(|s| anyhow::anyhow!("rdma-rpc: alloc_bytes({size}): {s}"))?;
                buf.copy_from_slice(&bytes);
                v.insert(buf.freeze()).clone()
            }
        };
        Ok(Payload {
            bytes: region.bytes(),
            region: Some(region),
            hint: true,
        })
    }

    fn blocking_call(&self, payload: &Payload) -> Result<()> {
        let size = payload.bytes.len();
        let r = self
            .blocking
            .echo(request(payload, self.deadline))
            .map_err(|s| anyhow::anyhow!("rdma-rpc: echo of {size} bytes: {s}"))?;
        check(size, r.get_ref().payload.len())
    }

    fn windowed(
        &self,
        k: usize,
        payload: &Payload,
        stop: StopRule,
    ) -> Result<(u64, std::time::Duration)> {
        if self.mode == AsyncMode::Pipeline {
            return self.pipelined(k, payload, &stop);
        }
        let (rt, client) = match &self.poller {
            None => (&self.rt, self.client.clone()),
            Some((rt, c)) => (rt, c.clone()),
        };
        let payload = payload.clone();
        let deadline = self.deadline;
        rt.block_on(client::windowed_async(k, stop, move || {
            call_once(client.clone(), payload.clone(), deadline)
        }))
    }
}

impl RpcClient {
    /// The latency phase with async calls: one task on the poller's two-worker runtime calls
    /// and awaits in a loop (the default async call: the poller thread completes it and wakes
    /// the task).
    fn async_latency(
        &mut self,
        size: usize,
        plan: &Plan,
        probe: &mut dyn Probe,
    ) -> Result<LatencyRun> {
        let payload = self.payload(size, true)?;
        let Some((rt, client)) = &self.poller else {
            bail!("rdma-rpc: async latency needs the poller's runtime");
        };
        let (deadline, plan) = (self.deadline, *plan);
        let run = |timed: bool| {
            let (client, payload) = (client.clone(), payload.clone());
            let task = rt.spawn(async move {
                let mut hist = measure::histogram();
                let start = Instant::now();
                let mut calls = 0u64;
                loop {
                    let over = if timed {
                        plan.done(start, plan.latency, calls)
                    } else {
                        plan.warm(start, calls)
                    };
                    if over {
                        break;
                    }
                    let t0 = Instant::now();
                    call_once(client.clone(), payload.clone(), deadline).await?;
                    measure::record(&mut hist, t0.elapsed());
                    calls += 1;
                }
                Ok::<_, anyhow::Error>((hist, calls, start.elapsed()))
            });
            rt.block_on(task)
                .map_err(|e| anyhow::anyhow!("rdma-rpc: async latency task: {e}"))?
        };
        run(false)?;
        let before = probe.snapshot()?;
        let (hist, calls, wall) = run(true)?;
        let cpu = probe.snapshot()?.since(before);
        Ok(LatencyRun {
            hist,
            calls,
            wall,
            cpu,
        })
    }

    /// `k` calls in flight through one pipeline on this thread, counted until `stop` says so
    /// (asked every 8th call, as `client::windowed_async` does); the calls still in flight
    /// then finish uncounted.
    fn pipelined(&self, k: usize, payload: &Payload, stop: &StopRule) -> Result<(u64, Duration)> {
        let mut p = self
            .pipelines
            .echo()
            .map_err(|s| anyhow::anyhow!("rdma-rpc: pipeline: {s}"))?;
        let size = payload.bytes.len();
        let start = Instant::now();
        let (mut count, mut stopped_at) = (0u64, None);
        loop {
            while stopped_at.is_none() && p.in_flight() < k {
                p.submit(0, request(payload, self.deadline))
                    .map_err(|s| anyhow::anyhow!("rdma-rpc: echo of {size} bytes: {s}"))?;
            }
            let Some((_, r)) = p.wait() else { break };
            let r = r.map_err(|s| anyhow::anyhow!("rdma-rpc: echo of {size} bytes: {s}"))?;
            check(size, r.get_ref().payload.len())?;
            if stopped_at.is_none() {
                count += 1;
                if count % 8 == 0 && stop(start, count) {
                    stopped_at = Some(start.elapsed());
                }
            }
        }
        Ok((count, stopped_at.unwrap_or_else(|| start.elapsed())))
    }
}

impl BenchClient for RpcClient {
    fn latency(&mut self, size: usize, plan: &Plan, probe: &mut dyn Probe) -> Result<LatencyRun> {
        if self.async_latency {
            return self.async_latency(size, plan, probe);
        }
        let payload = self.payload(size, false)?;
        let start = Instant::now();
        let mut n = 0;
        while !plan.warm(start, n) {
            self.blocking_call(&payload)?;
            n += 1;
        }
        let before = probe.snapshot()?;
        let mut hist = measure::histogram();
        let start = Instant::now();
        let mut calls = 0u64;
        while !plan.done(start, plan.latency, calls) {
            let t0 = Instant::now();
            self.blocking_call(&payload)?;
            measure::record(&mut hist, t0.elapsed());
            calls += 1;
        }
        let wall = start.elapsed();
        let cpu = probe.snapshot()?.since(before);
        Ok(LatencyRun {
            hist,
            calls,
            wall,
            cpu,
        })
    }

    fn rate(
        &mut self,
        size: usize,
        outstanding: usize,
        plan: &Plan,
        probe: &mut dyn Probe,
    ) -> Result<RateRun> {
        let payload = self.payload(size, self.poller.is_some())?;
        let p = *plan;
        self.windowed(outstanding, &payload, Arc::new(move |t, n| p.warm(t, n)))?;
        let before = probe.snapshot()?;
        let (calls, wall) = self.windowed(
            outstanding,
            &payload,
            Arc::new(move |t, n| p.done(t, p.rate, n)),
        )?;
        let cpu = probe.snapshot()?.since(before);
        Ok(RateRun { calls, wall, cpu })
    }

    fn streams(&mut self) -> Option<&mut dyn StreamClient> {
        Some(self)
    }
}

impl Replies for rpc_core::Streaming<EchoReply> {
    async fn next_len(&mut self) -> Result<Option<usize>> {
        self.message()
            .await
            .map(|m| m.map(|r| r.payload.len()))
            .map_err(|s| anyhow::anyhow!("rdma-rpc: stream: {s}"))
    }
}

impl StreamSystem for RpcClient {
    type Replies = rpc_core::Streaming<EchoReply>;

    fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    fn call_timeout(&self) -> Duration {
        self.deadline.unwrap_or(client::CALL_TIMEOUT)
    }

    async fn open_bidi(&self, requests: Outbox, limit: Duration) -> Result<Self::Replies> {
        let mut r = Request::new(requests);
        r.set_timeout(limit);
        let s = self
            .client
            .echo_bidi(r)
            .await
            .map_err(|s| anyhow::anyhow!("rdma-rpc: EchoBidi: {s}"))?;
        Ok(s.into_inner())
    }

    async fn open_stream(&self, count: u32, size: u32, limit: Duration) -> Result<Self::Replies> {
        let mut r = Request::new(StreamRequest { count, size });
        r.set_timeout(limit);
        let s = self
            .client
            .echo_stream(r)
            .await
            .map_err(|s| anyhow::anyhow!("rdma-rpc: EchoStream: {s}"))?;
        Ok(s.into_inner())
    }
}
