//! Interceptors in tonic's shape: a function over a call's request metadata (and timeout)
//! that returns the request, changed or not, or a [`Status`] that ends the call before it
//! goes further. On the server an [`InterceptedService`](crate::server::InterceptedService)
//! runs it before the handler (statically dispatched: the wrapper is generic over the
//! function); on the client [`Channel::with_interceptor`](crate::Channel::with_interceptor)
//! runs it before each call is sent. Neither allocates unless the function does.

use crate::{Request, Status};

/// A function run on each call's `Request<()>` (its metadata and timeout) before the call
/// goes on: return it (changed or not) to continue, or a status to end the call.
pub trait Interceptor: Send + Sync + 'static {
    /// Inspects or changes the request, or refuses the call.
    ///
    /// # Errors
    /// The status the call ends with.
    fn call(&self, request: Request<()>) -> Result<Request<()>, Status>;
}

impl<F> Interceptor for F
where
    F: Fn(Request<()>) -> Result<Request<()>, Status> + Send + Sync + 'static,
{
    fn call(&self, request: Request<()>) -> Result<Request<()>, Status> {
        self(request)
    }
}

/// Runs `f` on the metadata and timeout of `request` in place (the message and everything
/// else stay where they are).
pub(crate) fn apply<T>(f: &dyn Interceptor, request: &mut Request<T>) -> Result<(), Status> {
    let metadata = std::mem::take(request.metadata_mut());
    let out = f.call(Request::from_parts(metadata, (), request.timeout()))?;
    let (metadata, (), timeout) = out.into_parts();
    *request.metadata_mut() = metadata;
    request.replace_timeout(timeout);
    Ok(())
}
