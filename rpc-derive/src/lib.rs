//! `#[service]` on a Rust trait: rdma-rpc clients and servers without `.proto`, through the same
//! IR and emitter as `.proto` files (`rpc-codegen`).
//!
//! ```ignore
//! use rpc_core::{Status, Streaming};
//!
//! #[rpc_derive::service(package = "kv")]
//! pub trait Kv {
//!     /// Reads a key.
//!     async fn get(&self, request: GetRequest) -> Result<GetReply, Status>;
//!     /// Client streaming: the argument is `Streaming<Message>`.
//!     async fn put_many(&self, request: Streaming<PutRequest>) -> Result<PutReply, Status>;
//!     /// Server streaming: an associated stream type, returned as `Self::Type`.
//!     type Changes: Stream<Item = Result<Change, Status>>;
//!     async fn watch(&self, request: WatchRequest) -> Result<Self::Changes, Status>;
//! }
//! ```
//!
//! # What it generates
//!
//! - The trait itself, as written but with `Send + Sync + 'static` supertraits and each
//!   `async fn` turned into `fn .. -> impl Future<Output = ..> + Send` (stream types get
//!   `+ Send + 'static`). Implement it with plain `async fn`s, taking and returning bare
//!   messages.
//! - `kv_server` and `kv_client` modules, exactly as for a `.proto` service named `Kv` in
//!   package `kv` (paths `/kv.Kv/Get`, method names in `UpperCamelCase`): the tonic-shaped
//!   `kv_server::Kv` trait taking `Request<T>` and returning `Result<Response<U>, Status>`,
//!   `kv_server::KvServer<T>`, and `kv_client::KvClient`.
//! - A blanket `impl<T: Kv> kv_server::Kv for T` that wraps and unwraps messages. So
//!   `KvServer::new(MyKv)` works for any implementation of your trait. Handlers that need
//!   request metadata or the deadline, or that set response metadata, implement
//!   `kv_server::Kv` directly on a type that does not implement the simple trait.
//!
//! The service name is the trait name; the package comes from `package = ".."` (none by
//! default); `crate = "::path::to::rpc_core"` overrides the runtime path.
//!
//! A method may declare what running it twice does, as `.proto`'s `option idempotency_level`:
//! `#[rpc(idempotent)]` (`IDEMPOTENT`) or `#[rpc(no_side_effects)]` (`NO_SIDE_EFFECTS`). The
//! method's `MethodDesc` carries it (`rpc_core::Idempotency`), and a client with a
//! `rpc_core::RetryPolicy` may retry such a call even when it may have reached a handler.
//!
//! # Errors
//!
//! Problems are reported together, each at its span, and the macro never panics: methods that
//! are not `async`, receivers other than `&self`, not exactly one argument, generics, `const`
//! or `unsafe` methods, arguments or results that are not messages (checked by shape:
//! primitives, references, tuples, `String`, `Vec`, `Option`.. are refused; `()` is allowed),
//! return types other than `Result<Message, Status>`, reserved names (`new` and `connect`, the
//! client's constructors) and clashing names or method ids. Any other name is free: the
//! generated code names the runtime by full paths and imports nothing, and blocking calls and
//! pipelines live on their own client types under the methods' own names (see `rpc-codegen`).
#![deny(unsafe_code)]
#![warn(missing_docs)]

use proc_macro::TokenStream;

mod expand;

/// Turns a trait into an rdma-rpc service: see the [crate docs](crate).
#[proc_macro_attribute]
pub fn service(attr: TokenStream, item: TokenStream) -> TokenStream {
    expand::expand(attr.into(), item.into()).into()
}
