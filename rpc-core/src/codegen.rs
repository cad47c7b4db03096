//! The only contract between generated code (`rpc-codegen`, `#[service]`) and the runtime.
//! Generated code names each item by its full path (`::rpc_core::codegen::Status`), imports
//! nothing, and names nothing else of this crate.
#![doc(hidden)]

pub use std::future::Future;
pub use std::sync::Arc;

pub use futures_core::Stream;
pub use prost::Message;

pub use crate::Error as TransportError;
pub use crate::Interceptor;
pub use crate::client::{Channel, Pipeline};
pub use crate::method::{CallKind, Idempotency, MethodDesc, method_id};
pub use crate::request::{IntoRequest, IntoStreamingRequest, Metadata, Request, Response};
pub use crate::server::{Dispatched, IncomingCall, InterceptedService, Service};
pub use crate::status::{Code, Status};
pub use crate::streaming::Streaming;

/// What generated code needs of a request or reply type. `#[service]` states it as a `where`
/// clause spanned at the user's type, so that a type that is not a message is reported once,
/// there, instead of at every runtime call the generated code makes with it.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a message: requests and replies are prost messages or `()`",
    label = "not a prost message",
    note = "derive `prost::Message` on it (`#[derive(Clone, PartialEq, prost::Message)]`); it must also be `Default + Send + 'static`"
)]
pub trait RpcMessage: Message + Default + Send + 'static {}

impl<T: Message + Default + Send + 'static> RpcMessage for T {}
