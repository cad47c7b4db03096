//! [`Streaming`]: the stream of messages received on a streaming call.
//!
//! CONTRACT ONLY for now: the runtime behind it lands with issue 7.

use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::Status;

/// Messages of type `T` arriving on a streaming call, ending with the call's status.
#[derive(Debug)]
pub struct Streaming<T> {
    _marker: PhantomData<fn() -> T>,
}

impl<T> Streaming<T> {
    /// The next message, `Ok(None)` at the end of the stream, or the call's error status.
    ///
    /// # Errors
    /// The call's [`Status`] when it ended with one.
    ///
    /// # Cancel safety
    /// Cancel safe: a message is never lost when the future is dropped.
    pub async fn message(&mut self) -> Result<Option<T>, Status> {
        todo!("streaming runtime: issue 7")
    }
}

impl<T> futures_core::Stream for Streaming<T> {
    type Item = Result<T, Status>;

    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        todo!("streaming runtime: issue 7")
    }
}
