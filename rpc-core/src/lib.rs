//! rdma-rpc's runtime: a zero-copy RPC framework for RDMA clusters.
//!
//! Layers, arrows down only:
//!
//! ```text
//! codegen (contract for generated stubs)
//!   └─> server / client ──> connect (TCP bootstrap)
//!         └─> wire (sans-IO protocol) + buf (registered slots) + verbs (providers)
//! ```
//!
//! - [`verbs`]: one provider-neutral verbs API; [`verbs::soft`] (software RNIC, default) and
//!   `verbs::ib` (real RNICs, feature `ibverbs`).
//! - [`wire`]: frames, calls, credits, rendezvous; no I/O, no clock.
//! - [`buf`]: registered memory carved into send/receive slot rings and a bulk pool.
//! - [`server`], [`client`]: shards polling CQs, handler dispatch, futures and blocking calls.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

pub mod buf;
pub mod client;
pub mod codegen;
pub mod connect;
mod error;
pub mod link;
pub mod method;
mod request;
pub mod server;
mod status;
pub mod streaming;
pub mod verbs;
pub mod wire;

pub use client::{
    Channel, ChannelBuilder, Pipeline, PollerMode, RegisteredBytes, RegisteredBytesMut,
};
pub use error::{Error, ErrorKind};
pub use method::{CallKind, MethodDesc};
pub use request::{
    IntoRequest, IntoStreamingRequest, InvalidMetadata, MAX_METADATA_LEN, Metadata, Request,
    Response,
};
pub use server::{PollMode, RunningServer, Server, ServerBuilder};
pub use status::{Code, Status};
pub use streaming::Streaming;
