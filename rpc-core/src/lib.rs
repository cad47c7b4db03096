//! rdma-rpc's runtime: a zero-copy RPC framework for RDMA clusters.
//!
//! A service defined as a Rust trait (or in a `.proto`, through `rpc-codegen` in `build.rs`),
//! served and called on the default provider (the soft RNIC: no hardware needed):
//!
//! ```
//! use rpc_core::{Status, server::Server};
//!
//! #[derive(Clone, PartialEq, prost::Message)]
//! pub struct HelloRequest {
//!     #[prost(string, tag = "1")]
//!     pub name: String,
//! }
//!
//! #[derive(Clone, PartialEq, prost::Message)]
//! pub struct HelloReply {
//!     #[prost(string, tag = "1")]
//!     pub message: String,
//! }
//!
//! #[rpc_derive::service(package = "helloworld")]
//! pub trait Greeter {
//!     async fn say_hello(&self, request: HelloRequest) -> Result<HelloReply, Status>;
//! }
//!
//! struct MyGreeter;
//!
//! impl Greeter for MyGreeter {
//!     async fn say_hello(&self, request: HelloRequest) -> Result<HelloReply, Status> {
//!         Ok(HelloReply { message: format!("Hello {}!", request.name) })
//!     }
//! }
//!
//! # #[tokio::main] async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let server = Server::builder()
//!     .add_service(greeter_server::GreeterServer::new(MyGreeter))
//!     .bind("127.0.0.1:0")
//!     .await?;
//! let client = greeter_client::GreeterClient::connect(server.local_addr().to_string()).await?;
//! let reply = client.say_hello(HelloRequest { name: "Ada".into() }).await?;
//! assert_eq!(reply.into_inner().message, "Hello Ada!");
//! server.shutdown().await;
//! # Ok(()) }
//! ```
//!
//! Layers, arrows down only:
//!
//! ```text
//! codegen (contract for generated stubs)
//!   └─> server / client ──> connect (TCP bootstrap)
//!         └─> call (held stream frames, lend ledger, call tables: shared by both)
//!               └─> wire (sans-IO protocol) + link (a connection's QPs) + buf (registered
//!                   slots, bulk pool) + verbs (providers)
//! ```
//!
//! - [`verbs`]: one provider-neutral verbs API; [`verbs::soft`] (software RNIC, default) and
//!   `verbs::ib` (real RNICs, feature `ibverbs`).
//! - `wire` (internal, public for fuzzing): frames, calls, credits, rendezvous; no I/O, no clock.
//! - `buf` (internal): registered memory carved into send/receive slot rings and a bulk pool.
//! - [`server`], [`client`]: shards polling CQs, handler dispatch, futures and blocking calls.
//! - `memcopy` (internal, below every layer, depends on none): the payload copies of `verbs::soft`,
//!   `buf`, `link` and streams, steered around a `memcpy` slow case.
//! - `doorbell` (internal, depends on none): how a sleeping poll loop is woken, for the server's
//!   shards and the client's poller thread and callers alike.
//!
//! # Registered memory: who may touch which bytes, and when
//!
//! Zero copy lends registered memory: to the NIC while a work request is posted, to the user's
//! `Bytes` after a receive, to the peer through a remote key. Every loan is bounded and ends
//! at a known point; this is the trust model.
//!
//! | memory | who may touch it | what a peer can do | the loan ends |
//! |---|---|---|---|
//! | **send slot** (a client connection's arena; on a server, the shard's, shared by its connections; local access only) | the caller encoding a frame into it, then the NIC from `post_send` | nothing: slots have no remote key | at the send's completion (or at once for an inline send), or, for a SEND that never completes, when its QP is destroyed; never earlier |
//! | **receive slot** (a client connection's arena; on a server, the shard's receive pool behind one SRQ) | the NIC while its RECV is posted, then the decoder; a `bytes` field of 512 B or more may borrow it | send into it only while posted (SEND/RECV) and only with a credit, which the receiver grants from slots it has posted; no remote key | when the decoded message and every `Bytes` taken from it are dropped. A client lends at most half of its receive slots at once (its *lending budget*); a server shard lends a slot only from the pool's spare slots (at most half the pool), and the connection gets its credit back at once. Past either, large fields are copied and the slot goes back at once, so keeping received data never stalls a connection |
//! | **rendezvous source** (a bulk buffer holding a large message) | the sender, until it advertises it; then read-only for everyone | RDMA READ of exactly the advertised bytes, through a key of its own, from this connection's peer only (soft) | at the peer's `BulkRelease`, or when the call ends: the key is revoked before the buffer returns to its pool |
//! | **landing zone** (a bulk buffer a client lends for a large response) | the server's NIC, then the client once the response arrived | RDMA WRITE of exactly the advertised bytes, from this connection's server only (soft) | when the response's write completes: the key is revoked before the client reads a byte |
//! | **registered request bytes** ([`Channel::alloc_bytes`]) | the user, until frozen; then read-only, shared by the requests that reference it | RDMA READ of the referenced field's bytes, one key per request | when that request's server is done (`BulkRelease` or the call's end) |
//! | **explicit region** ([`Channel::alloc_region`], a [`Region`]) | the user, whenever no [`Lease`] of it lives; the server's handlers through a lease | what the lease grants: READ and/or WRITE of the lent range, by this connection's server, from a handler whose call still runs | when the lease is dropped (its key is revoked; a leaked lease is revoked before the region's bytes are touched again), or for a handler, when its call ends (`FAILED_PRECONDITION` after) |
//!
//! Remote keys are windows ([`verbs::Pd::bind_window`]): a fresh key per loan, with the one
//! right the use needs, covering the advertised range only, revoked when the loan ends. The
//! bulk pool's regions are registered for local access, so their own keys give a peer nothing.
//! A stale, forged, out-of-range or wrong-right key fails the peer's operation with
//! `REM_ACCESS_ERR`, and its connection breaks (as RC does); no other connection is touched.
//!
//! Limits, plainly: on the soft provider a window is bound to the peer's RNIC instance (one
//! per `Channel` today), so a peer cannot use a key lent to another connection. On the ib
//! provider a window is a registration of the lent range (`ibv_reg_mr`, deregistered on
//! revocation): fresh, least-privilege and revoked, but usable by any QP of the protection
//! domain while it lives (type-2 memory windows bound to the QP would close that). A lease
//! borrows its region mutably, so safe code cannot read bytes the server may be writing.
//!
//! Posted buffers belong to the NIC: nothing named by a posted work request is reused before
//! its completion is polled or its QP destroyed. A client's receive window, which grows and
//! shrinks with its calls in flight, deregisters a region only once every slot of it is back
//! from the NIC and from whoever borrowed it.
#![deny(unsafe_op_in_unsafe_fn)]
#![warn(missing_docs)]

mod buf;
mod call;
pub mod client;
pub mod codegen;
mod connect;
mod doorbell;
mod error;
mod fdtable;
pub mod intercept;
mod link;
mod memcopy;
pub mod method;
mod poll_policy;
mod queue;
mod request;
pub mod server;
mod slot_table;
pub mod stats;
mod status;
pub mod streaming;
pub mod trace;
pub mod verbs;
// The sans-IO protocol core: public for the fuzz targets and the protocol's own tests only.
#[doc(hidden)]
pub mod wire;

pub use buf::Geometry;

/// Hooks for this crate's own integration tests (counters of internals, the handshake's
/// messages); not part of the API, and may change without notice.
#[doc(hidden)]
pub mod testing {
    pub use crate::connect::Message as Handshake;
    pub use crate::connect::{Hello, Refusal};
    pub use crate::link::{ParkedStats, SIGNAL_EVERY, parked_stats};
}
pub use client::{
    Balancer, Channel, ChannelBuilder, ChannelSlots, ClientPoller, Lease, Pipeline, Region,
    RegisteredBytes, RegisteredBytesMut, RetryPolicy,
};
pub use error::{Error, TransportErrorKind};
/// The `Stream` trait streaming methods take and return (`futures_core::Stream`), re-exported
/// so a streaming service needs no dependency beyond this crate.
pub use futures_core::Stream;
pub use intercept::Interceptor;
pub use method::{CallKind, Idempotency, MethodDesc};
pub use request::{
    IntoRequest, IntoStreamingRequest, InvalidMetadata, MAX_METADATA_LEN, Metadata, Request,
    Response,
};
pub use server::{ReceivePool, RunningServer, Server, ServerBuilder, ShardPolling};
pub use status::{Code, MAX_STATUS_MESSAGE_LEN, NOT_EXECUTED_KEY, STATUS_DETAILS_KEY, Status};
pub use streaming::Streaming;
