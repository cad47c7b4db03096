//! The benchmark service, implemented once for rdma-rpc (and served over gRPC through the
//! generated adapter), and once natively for tonic, which is what a gRPC user writes and gives
//! tonic its best showing.

use std::marker::PhantomData;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;

use crate::proto::{EchoReply, EchoRequest, StreamRequest};

/// The reply payload for a request: the request's own bytes (no copy: with rdma-rpc they still
/// live in the receive slot, with tonic in its decode buffer), or `reply_size` bytes.
fn reply_payload(req: EchoRequest) -> Bytes {
    if req.reply_size == 0 {
        req.payload
    } else {
        Bytes::from(vec![0x5a; req.reply_size as usize])
    }
}

/// `count` replies of `size` bytes (`EchoStream`); `S` is the status type of the framework.
#[derive(Debug)]
pub struct Replies<S> {
    left: u32,
    payload: Bytes,
    _status: PhantomData<fn() -> S>,
}

impl<S> Replies<S> {
    fn new(req: &StreamRequest) -> Self {
        Replies {
            left: req.count,
            payload: Bytes::from(vec![0x5a; req.size as usize]),
            _status: PhantomData,
        }
    }
}

impl<S> futures_core::Stream for Replies<S> {
    type Item = Result<EchoReply, S>;

    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.left == 0 {
            return Poll::Ready(None);
        }
        this.left -= 1;
        Poll::Ready(Some(Ok(EchoReply {
            payload: this.payload.clone(),
        })))
    }
}

/// The replies of `EchoBidi`: every request message of the stream `S` answered by one reply,
/// as `Echo` answers (no copy: the reply shares the request's payload); the call ends when the
/// request stream does, and with its error if it fails. `E` is the status type of the framework.
#[derive(Debug)]
pub struct EchoEach<S> {
    requests: S,
}

impl<S> EchoEach<S> {
    fn new(requests: S) -> Self {
        EchoEach { requests }
    }
}

impl<S, E> futures_core::Stream for EchoEach<S>
where
    S: futures_core::Stream<Item = Result<EchoRequest, E>> + Unpin,
{
    type Item = Result<EchoReply, E>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.get_mut().requests)
            .poll_next(cx)
            .map(|item| {
                item.map(|r| {
                    r.map(|req| EchoReply {
                        payload: reply_payload(req),
                    })
                })
            })
    }
}

/// The rdma-rpc implementation.
#[derive(Clone, Copy, Debug, Default)]
pub struct BenchService;

impl crate::proto::bench_server::Bench for BenchService {
    async fn echo(
        &self,
        request: rpc_core::Request<EchoRequest>,
    ) -> Result<rpc_core::Response<EchoReply>, rpc_core::Status> {
        let payload = reply_payload(request.into_inner());
        Ok(rpc_core::Response::new(EchoReply { payload }))
    }

    type EchoStreamStream = Replies<rpc_core::Status>;

    async fn echo_stream(
        &self,
        request: rpc_core::Request<StreamRequest>,
    ) -> Result<rpc_core::Response<Self::EchoStreamStream>, rpc_core::Status> {
        Ok(rpc_core::Response::new(Replies::new(request.get_ref())))
    }

    type EchoBidiStream = EchoEach<rpc_core::Streaming<EchoRequest>>;

    async fn echo_bidi(
        &self,
        request: rpc_core::Request<rpc_core::Streaming<EchoRequest>>,
    ) -> Result<rpc_core::Response<Self::EchoBidiStream>, rpc_core::Status> {
        Ok(rpc_core::Response::new(EchoEach::new(request.into_inner())))
    }
}

/// The native tonic implementation.
#[derive(Clone, Copy, Debug, Default)]
pub struct TonicBenchService;

#[tonic::async_trait]
impl crate::proto::bench_tonic::bench_server::Bench for TonicBenchService {
    async fn echo(
        &self,
        request: tonic::Request<EchoRequest>,
    ) -> Result<tonic::Response<EchoReply>, tonic::Status> {
        let payload = reply_payload(request.into_inner());
        Ok(tonic::Response::new(EchoReply { payload }))
    }

    type EchoStreamStream = Replies<tonic::Status>;

    async fn echo_stream(
        &self,
        request: tonic::Request<StreamRequest>,
    ) -> Result<tonic::Response<Self::EchoStreamStream>, tonic::Status> {
        Ok(tonic::Response::new(Replies::new(request.get_ref())))
    }

    type EchoBidiStream = EchoEach<tonic::Streaming<EchoRequest>>;

    async fn echo_bidi(
        &self,
        request: tonic::Request<tonic::Streaming<EchoRequest>>,
    ) -> Result<tonic::Response<Self::EchoBidiStream>, tonic::Status> {
        Ok(tonic::Response::new(EchoEach::new(request.into_inner())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_core::Stream;

    #[test]
    fn echo_returns_the_same_bytes_or_the_asked_size() {
        let p = Bytes::from_static(b"hello");
        let same = reply_payload(EchoRequest {
            payload: p.clone(),
            reply_size: 0,
        });
        assert_eq!(same, p);
        assert_eq!(same.as_ptr(), p.as_ptr(), "no copy");
        let sized = reply_payload(EchoRequest {
            payload: p,
            reply_size: 7,
        });
        assert_eq!(sized.len(), 7);
    }

    #[test]
    fn replies_yield_count_messages() {
        let mut r = Replies::<()>::new(&StreamRequest { count: 3, size: 4 });
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut n = 0;
        while let Poll::Ready(Some(item)) = Pin::new(&mut r).poll_next(&mut cx) {
            assert_eq!(item.map(|m| m.payload.len()), Ok(4));
            n += 1;
        }
        assert_eq!(n, 3);
    }

    #[test]
    fn echo_each_answers_every_request_then_ends_with_the_error() {
        struct Reqs(Vec<Result<EchoRequest, &'static str>>);
        impl Stream for Reqs {
            type Item = Result<EchoRequest, &'static str>;
            fn poll_next(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
                let v = &mut self.get_mut().0;
                Poll::Ready((!v.is_empty()).then(|| v.remove(0)))
            }
        }
        let p = Bytes::from_static(b"ping");
        let mut e = EchoEach::new(Reqs(vec![
            Ok(EchoRequest {
                payload: p.clone(),
                reply_size: 0,
            }),
            Ok(EchoRequest {
                payload: p.clone(),
                reply_size: 9,
            }),
            Err("boom"),
        ]));
        let waker = std::task::Waker::noop();
        let mut cx = Context::from_waker(waker);
        let mut next = || match Pin::new(&mut e).poll_next(&mut cx) {
            Poll::Ready(x) => x,
            Poll::Pending => panic!("never pending"),
        };
        let first = next().unwrap().unwrap();
        assert_eq!(first.payload, p);
        assert_eq!(first.payload.as_ptr(), p.as_ptr(), "no copy");
        assert_eq!(next().unwrap().unwrap().payload.len(), 9);
        assert_eq!(next().unwrap().unwrap_err(), "boom");
        assert!(next().is_none());
    }
}
