//! The only contract between generated code (`rpc-codegen`, `#[service]`) and the runtime.
//! Generated code names each item by its full path (`::rpc_core::codegen::Status`), imports
//! nothing, and names nothing else of this crate.
#![doc(hidden)]

pub use std::future::Future;
pub use std::sync::Arc;

pub use futures_core::Stream;
pub use prost::Message;

pub use crate::Error as TransportError;
pub use crate::client::{Channel, Pipeline};
pub use crate::method::{CallKind, MethodDesc, method_id};
pub use crate::request::{IntoRequest, IntoStreamingRequest, Metadata, Request, Response};
pub use crate::server::{Dispatched, IncomingCall, Service};
pub use crate::status::{Code, Status};
pub use crate::streaming::Streaming;
