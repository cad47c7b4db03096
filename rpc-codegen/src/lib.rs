//! rdma-rpc code generation: one service IR, one emitter, two front ends.
//!
//! - The IR: [`ServiceDef`] and [`MethodDef`] (names, paths, message types, the four call
//!   kinds, docs).
//! - The emitter: [`generate`] turns a service into a `<service>_client` and a
//!   `<service>_server` module in tonic's shape; [`pretty`] formats them. Generated code names
//!   nothing of the runtime but `rpc_core::codegen::*` (the path is configurable) and absolute
//!   `::core` paths, so it also compiles under `#![no_implicit_prelude]`.
//! - The `.proto` front end (feature `proto`, default): [`configure`] returns a [`Builder`]
//!   for `build.rs`; protox compiles the files (no `protoc` anywhere), prost-build generates the
//!   messages and [`ServiceGenerator`] the services.
//! - The Rust front end is `#[rpc_derive::service]`, which builds the same IR.
//!
//! # What is generated for `service Greeter { rpc SayHello(HelloRequest) returns (HelloReply); }`
//!
//! ```ignore
//! pub mod greeter_client {
//!     pub struct GreeterClient { .. }              // Clone + Debug, wraps a Channel
//!     impl GreeterClient {
//!         pub async fn connect(addr: impl AsRef<str>) -> Result<Self, TransportError>;
//!         pub fn new(inner: Channel) -> Self;
//!         pub fn channel(&self) -> &Channel;
//!         pub async fn say_hello(&self, request: impl IntoRequest<HelloRequest>)
//!             -> Result<Response<HelloReply>, Status>;
//!         pub fn say_hello_blocking(&self, request: impl IntoRequest<HelloRequest>)
//!             -> Result<Response<HelloReply>, Status>;   // unary methods only
//!         pub fn say_hello_pipeline(&self)
//!             -> Result<Pipeline<HelloRequest, HelloReply>, Status>;   // unary methods only
//!     }
//! }
//! pub mod greeter_server {
//!     pub const SAY_HELLO: MethodDesc;                  // "/helloworld.Greeter/SayHello"
//!     pub const METHODS: &[MethodDesc];
//!     pub trait Greeter: Send + Sync + 'static {
//!         fn say_hello(&self, request: Request<HelloRequest>)
//!             -> impl Future<Output = Result<Response<HelloReply>, Status>> + Send;
//!     }
//!     pub struct GreeterServer<T> { .. }               // implements rpc_core's Service
//! }
//! ```
//!
//! Implement the trait with `async fn say_hello(&self, request: Request<HelloRequest>) ->
//! Result<Response<HelloReply>, Status>`. Server-streaming methods add an associated type
//! `type ListFeaturesStream: Stream<Item = Result<Feature, Status>> + Send + 'static` and return
//! `Response<Self::ListFeaturesStream>`; client-streaming methods take
//! `Request<Streaming<Point>>`; clients pass anything `IntoStreamingRequest`.
//!
//! # Names
//!
//! Method names are prost's: `snake_case`, Rust keywords as raw identifiers (`r#type`; its
//! constant is `TYPE`, its blocking variant `type_blocking`), and `self`/`super`/`crate`/`Self`
//! with a `_` suffix. Method ids are FNV-1a of `/package.Service/Method`; two methods of a
//! service with the same id, the same Rust name, or a name the generated code uses itself
//! (`new`, `connect`, `channel`, `methods`, `<unary>_blocking`, `<unary>_pipeline`) are refused
//! at generation time.
//! A service named like one of the runtime items generated code imports ([`CODEGEN_NAMES`]) is
//! refused too.
//!
//! # tonic
//!
//! With the `tonic` feature, `Builder::emit_tonic` also emits tonic's gRPC client and server
//! for each service in the same prost pass, in a `<service>_tonic` module, plus a
//! `<Service>TonicAdapter<T>` that serves an implementation of our trait over gRPC (unary and
//! server-streaming methods; client-streaming and bidirectional methods answer
//! `UNIMPLEMENTED` through the adapter for now).
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "proto")]
mod docs;
mod emit;
mod ir;
#[cfg(feature = "proto")]
mod proto;
#[cfg(feature = "tonic")]
mod tonic;

pub use emit::{EmitOptions, generate, pretty};
pub use ir::{
    CODEGEN_NAMES, CallKind, CodegenError, MethodDef, RESERVED_METHOD_NAMES, ServiceDef, method_id,
};
#[cfg(feature = "proto")]
pub use proto::{Builder, ServiceGenerator, compile_protos, configure, service_def};
