//! rdma-rpc code generation: one service IR, one emitter, two front ends.
//!
//! - The IR: [`ServiceDef`] and [`MethodDef`] (names, paths, message types, the four call
//!   kinds, docs).
//! - The emitter: [`generate`] turns a service into a `<service>_client` and a
//!   `<service>_server` module in tonic's shape; [`pretty`] formats them. Generated code names
//!   every runtime item by its full path (`::rpc_core::codegen::Status`; the crate path is
//!   configurable) and the standard library's by `::core` paths, imports nothing into the
//!   modules it writes, and so compiles under `#![no_implicit_prelude]` and next to any name
//!   of the user's.
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
//!         pub async fn say_hello(&self, request: impl IntoRequest<HelloRequest>)
//!             -> Result<Response<HelloReply>, Status>;
//!     }
//!     pub struct GreeterBlockingClient { .. }      // unary methods only, same names
//!     impl GreeterBlockingClient {
//!         pub fn new(inner: Channel) -> Self;
//!         pub fn say_hello(&self, request: impl IntoRequest<HelloRequest>)
//!             -> Result<Response<HelloReply>, Status>;
//!     }
//!     pub struct GreeterPipelineClient { .. }      // unary methods only, same names
//!     impl GreeterPipelineClient {
//!         pub fn new(inner: Channel) -> Self;
//!         pub fn say_hello(&self) -> Result<Pipeline<HelloRequest, HelloReply>, Status>;
//!     }
//!     // Each of the three: From<Channel>, AsRef<Channel>; the last two: From<GreeterClient>.
//! }
//! pub mod greeter_server {
//!     pub const SAY_HELLO: MethodDesc;                  // "/helloworld.Greeter/SayHello"
//!     pub trait Greeter: Send + Sync + 'static {
//!         fn say_hello(&self, request: Request<HelloRequest>)
//!             -> impl Future<Output = Result<Response<HelloReply>, Status>> + Send;
//!     }
//!     pub struct GreeterServer<T> { .. }               // implements rpc_core's Service
//!     impl<T> GreeterServer<T> {
//!         pub const METHODS: &'static [MethodDesc];    // every method, in order
//!     }
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
//! The async client is tonic's: the same type, module and method names. The blocking and
//! pipelined entry points of a unary method are not extra methods with a suffix (a method
//! `RunPipeline` next to `Run` would take the name) but methods of the same name on two more
//! types, [`GreeterBlockingClient`] and [`GreeterPipelineClient`], built from a client with
//! `From`:
//!
//! ```ignore
//! let client = GreeterClient::connect("10.0.0.1:50051").await?;
//! let reply = client.say_hello(request).await?;                               // async
//! let blocking = GreeterBlockingClient::from(client.clone());
//! let reply = blocking.say_hello(request)?;                                   // blocking
//! let mut pipeline = GreeterPipelineClient::from(client).say_hello()?;        // pipelined
//! ```
//!
//! So a method name is refused only when Rust refuses it or when it is `new` or `connect` (the
//! client's constructors; tonic's clients refuse those and six more). Services, messages and
//! methods may be named like runtime items (`Status`, `Channel`, `Pipeline`, `Message`..).
//!
//! Method names are prost's: `snake_case`, Rust keywords as raw identifiers (`r#type`; its
//! constant is `TYPE`), and `self`/`super`/`crate`/`Self` with a `_` suffix. Module names are
//! tonic-build's (`Self_` gives `self__server`, `HTTPProxy` `h_t_t_p_proxy_server`; see
//! [`tonic_snake_case`]). Method ids are FNV-1a of `/package.Service/Method`; two methods of a
//! service with the same id, the same Rust name, the same constant or the same stream type are
//! refused at generation time.
//!
//! [`GreeterBlockingClient`]: ServiceDef::blocking_client_type
//! [`GreeterPipelineClient`]: ServiceDef::pipeline_client_type
//!
//! # tonic
//!
//! With the `tonic` feature, `Builder::emit_tonic` also emits tonic's gRPC client and server
//! for each service in the same prost pass, in a `<service>_tonic` module, plus a
//! `<Service>TonicAdapter<T>` that serves an implementation of our trait over gRPC (unary and
//! server-streaming methods; client-streaming and bidirectional methods answer
//! `UNIMPLEMENTED` through the adapter for now). Services named `Arc`, `Box`, `Option`,
//! `Default`, `Context`, `Poll`, `Body`, `BoxFuture` or `StdError` break tonic's own code (it
//! names those items without a path); generate them without `emit_tonic`.
#![deny(unsafe_code)]
#![warn(missing_docs)]

#[cfg(feature = "proto")]
mod docs;
mod emit;
#[cfg(feature = "proto")]
mod error;
mod ir;
#[cfg(feature = "proto")]
mod proto;
#[cfg(feature = "tonic")]
mod tonic;

pub use emit::{EmitOptions, generate, message_bound, pretty, rebase};
#[cfg(feature = "proto")]
pub use error::{Error, Location, Problem};
pub use ir::{
    CallKind, CodegenError, Idempotency, MethodDef, RESERVED_METHOD_NAMES, ServiceDef, method_id,
    tonic_snake_case,
};
#[cfg(feature = "proto")]
pub use proto::{Builder, ServiceGenerator, compile_protos, configure, service_def};
