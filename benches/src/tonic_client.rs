//! System (b): tonic 0.14 (gRPC over HTTP/2) on TCP loopback with TCP_NODELAY, through tonic's
//! client generated from the same `bench.proto`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use bytes::Bytes;

use crate::client::{self, BenchClient, Probe, StopRule};
use crate::measure::{self, LatencyRun, Plan, RateRun};
use crate::proto::bench_tonic::bench_client::BenchClient as Generated;
use crate::proto::{EchoReply, EchoRequest, StreamRequest};
use crate::stream::{Outbox, Replies, StreamClient, StreamSystem};

/// Largest gRPC message either side accepts (tonic's default is 4 MiB).
pub const MAX_MESSAGE: usize = 64 << 20;

/// The tokio runtime tonic runs on (client and server alike).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Flavor {
    /// One thread (`new_current_thread`).
    Ct,
    /// Two worker threads (`new_multi_thread`), one per core of the machine.
    Mt,
}

/// HTTP/2 flow-control settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Window {
    /// Initial stream and connection windows in bytes; `None` keeps the default (64 KiB).
    pub initial: Option<u32>,
    /// BDP-based adaptive windows.
    pub adaptive: bool,
}

/// Builds a runtime of `flavor`.
///
/// # Errors
/// When the runtime cannot be created.
pub fn runtime(flavor: Flavor) -> Result<tokio::runtime::Runtime> {
    let rt = match flavor {
        Flavor::Ct => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?,
        Flavor::Mt => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?,
    };
    Ok(rt)
}

struct TonicClient {
    deadline: Option<Duration>,
    rt: tokio::runtime::Runtime,
    client: Generated<tonic::transport::Channel>,
}

/// Connects to the tonic server at `addr`. Calls carry `deadline` as their timeout.
///
/// # Errors
/// When the connection fails.
pub fn connect(
    addr: SocketAddr,
    flavor: Flavor,
    window: Window,
    deadline: Option<Duration>,
) -> Result<Box<dyn BenchClient>> {
    let rt = runtime(flavor)?;
    let client = rt.block_on(async {
        let mut ep = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))?
            .tcp_nodelay(true)
            .connect_timeout(std::time::Duration::from_secs(10));
        if let Some(w) = window.initial {
            ep = ep
                .initial_stream_window_size(w)
                .initial_connection_window_size(w);
        }
        if window.adaptive {
            ep = ep.http2_adaptive_window(true);
        }
        let ch = ep
            .connect()
            .await
            .with_context(|| format!("tonic: connect to {addr}"))?;
        Ok::<_, anyhow::Error>(
            Generated::new(ch)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        )
    })?;
    Ok(Box::new(TonicClient {
        deadline,
        rt,
        client,
    }))
}

async fn call_once(
    mut client: Generated<tonic::transport::Channel>,
    payload: Bytes,
    deadline: Option<Duration>,
) -> Result<()> {
    let size = payload.len();
    let mut req = tonic::Request::new(EchoRequest {
        payload,
        reply_size: 0,
    });
    if let Some(d) = deadline {
        req.set_timeout(d);
    }
    let r = client
        .echo(req)
        .await
        .map_err(|s| anyhow::anyhow!("tonic: echo of {size} bytes: {s}"))?;
    let got = r.get_ref().payload.len();
    if got != size {
        bail!("tonic: echo of {size} bytes came back with {got}");
    }
    Ok(())
}

impl TonicClient {
    fn windowed(
        &self,
        k: usize,
        payload: &Bytes,
        stop: StopRule,
    ) -> Result<(u64, std::time::Duration)> {
        let client = self.client.clone();
        let payload = payload.clone();
        let deadline = self.deadline;
        self.rt.block_on(client::windowed_async(k, stop, move || {
            call_once(client.clone(), payload.clone(), deadline)
        }))
    }
}

impl BenchClient for TonicClient {
    fn latency(&mut self, size: usize, plan: &Plan, probe: &mut dyn Probe) -> Result<LatencyRun> {
        let payload = client::payload(size);
        let p = *plan;
        self.windowed(1, &payload, Arc::new(move |t, n| p.warm(t, n)))?;
        let before = probe.snapshot()?;
        let client = self.client.clone();
        let deadline = self.deadline;
        let (hist, calls, wall) = self.rt.block_on(async move {
            let mut hist = measure::histogram();
            let start = Instant::now();
            let mut calls = 0u64;
            while !p.done(start, p.latency, calls) {
                let t0 = Instant::now();
                call_once(client.clone(), payload.clone(), deadline).await?;
                measure::record(&mut hist, t0.elapsed());
                calls += 1;
            }
            Ok::<_, anyhow::Error>((hist, calls, start.elapsed()))
        })?;
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
        let payload = client::payload(size);
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

impl Replies for tonic::Streaming<EchoReply> {
    async fn next_len(&mut self) -> Result<Option<usize>> {
        self.message()
            .await
            .map(|m| m.map(|r| r.payload.len()))
            .map_err(|s| anyhow::anyhow!("tonic: stream: {s}"))
    }
}

impl StreamSystem for TonicClient {
    type Replies = tonic::Streaming<EchoReply>;

    fn runtime(&self) -> &tokio::runtime::Runtime {
        &self.rt
    }

    fn call_timeout(&self) -> Duration {
        self.deadline.unwrap_or(client::CALL_TIMEOUT)
    }

    async fn open_bidi(&self, requests: Outbox, limit: Duration) -> Result<Self::Replies> {
        let mut r = tonic::Request::new(requests);
        r.set_timeout(limit);
        let s = self
            .client
            .clone()
            .echo_bidi(r)
            .await
            .map_err(|s| anyhow::anyhow!("tonic: EchoBidi: {s}"))?;
        Ok(s.into_inner())
    }

    async fn open_stream(&self, count: u32, size: u32, limit: Duration) -> Result<Self::Replies> {
        let mut r = tonic::Request::new(StreamRequest { count, size });
        r.set_timeout(limit);
        let s = self
            .client
            .clone()
            .echo_stream(r)
            .await
            .map_err(|s| anyhow::anyhow!("tonic: EchoStream: {s}"))?;
        Ok(s.into_inner())
    }
}
