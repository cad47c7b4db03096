//! One implementation of our generated traits, served over gRPC by tonic through the generated
//! adapters, called with tonic's generated clients (loopback TCP, bounded by timeouts).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use rpc_codegen_check::{bench, helloworld};
use rpc_core::{Code, Request, Response, Status, Streaming};

struct Greeter;

impl helloworld::greeter_server::Greeter for Greeter {
    async fn say_hello(
        &self,
        request: Request<helloworld::HelloRequest>,
    ) -> Result<Response<helloworld::HelloReply>, Status> {
        let name = request.get_ref().name.clone();
        if name.is_empty() {
            let mut status = Status::invalid_argument("name is empty");
            status
                .metadata_mut()
                .insert("x-hint", "set a name")
                .unwrap();
            return Err(status);
        }
        let timeout = request
            .timeout()
            .map_or("none".to_owned(), |t| format!("{}ms", t.as_millis()));
        let user = request
            .metadata()
            .get_str("x-user")
            .unwrap_or("nobody")
            .to_owned();
        let mut reply = Response::new(helloworld::HelloReply {
            message: format!("Hello {name}! (user {user}, timeout {timeout})"),
        });
        reply
            .metadata_mut()
            .insert("x-served-by", "rdma-rpc")
            .unwrap();
        reply
            .metadata_mut()
            .insert("x-raw-bin", vec![0u8, 1, 255])
            .unwrap();
        Ok(reply)
    }
}

/// Replies of `count` payloads of `size` bytes, then possibly an error.
struct Replies {
    left: u32,
    size: usize,
    fail_at_end: bool,
}

impl futures_core::Stream for Replies {
    type Item = Result<bench::EchoReply, Status>;
    fn poll_next(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        if this.left == 0 {
            if this.fail_at_end {
                this.fail_at_end = false;
                return Poll::Ready(Some(Err(Status::resource_exhausted("enough"))));
            }
            return Poll::Ready(None);
        }
        this.left -= 1;
        Poll::Ready(Some(Ok(bench::EchoReply {
            payload: vec![7u8; this.size].into(),
        })))
    }
}

struct Bench;

impl bench::bench_server::Bench for Bench {
    async fn echo(
        &self,
        request: Request<bench::EchoRequest>,
    ) -> Result<Response<bench::EchoReply>, Status> {
        let r = request.into_inner();
        let payload = if r.reply_size == 0 {
            r.payload
        } else {
            vec![1u8; r.reply_size as usize].into()
        };
        Ok(Response::new(bench::EchoReply { payload }))
    }

    type EchoStreamStream = Replies;

    async fn echo_stream(
        &self,
        request: Request<bench::StreamRequest>,
    ) -> Result<Response<Replies>, Status> {
        let r = request.into_inner();
        Ok(Response::new(Replies {
            left: r.count,
            size: r.size as usize,
            fail_at_end: r.count == 3,
        }))
    }

    type EchoBidiStream = Replies;

    async fn echo_bidi(
        &self,
        _request: Request<Streaming<bench::EchoRequest>>,
    ) -> Result<Response<Replies>, Status> {
        Err(Status::internal("not reached through the adapter"))
    }
}

async fn serve() -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let greeter = helloworld::greeter_tonic::GreeterTonicAdapter::new(Greeter);
    let bench = bench::bench_tonic::BenchTonicAdapter::new(Bench);
    tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(greeter.into_service())
            .add_service(bench.into_service())
            .serve_with_incoming_shutdown(
                tokio_stream::wrappers::TcpListenerStream::new(listener),
                async {
                    let _ = stopped.await;
                },
            )
            .await
            .unwrap();
    });
    (addr, stop)
}

#[tokio::test]
async fn one_implementation_serves_grpc_through_the_adapter() {
    tokio::time::timeout(Duration::from_secs(30), async {
        let (addr, stop) = serve().await;
        let url = format!("http://{addr}");
        let mut greeter =
            helloworld::greeter_tonic::greeter_client::GreeterClient::connect(url.clone())
                .await
                .unwrap();

        // Unary: message, request metadata and timeout in, response metadata out.
        let mut request = tonic::Request::new(helloworld::HelloRequest { name: "Ada".into() });
        request
            .metadata_mut()
            .insert("x-user", "alice".parse().unwrap());
        request.set_timeout(Duration::from_millis(1500));
        let reply = greeter.say_hello(request).await.unwrap();
        assert_eq!(
            reply.get_ref().message,
            "Hello Ada! (user alice, timeout 1500ms)"
        );
        assert_eq!(reply.metadata().get("x-served-by").unwrap(), "rdma-rpc");
        let raw = reply.metadata().get_bin("x-raw-bin").unwrap();
        assert_eq!(raw.to_bytes().unwrap().as_ref(), &[0u8, 1, 255]);

        // Status: code, message and metadata.
        let err = greeter
            .say_hello(helloworld::HelloRequest::default())
            .await
            .unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert_eq!(err.message(), "name is empty");
        assert_eq!(err.metadata().get("x-hint").unwrap(), "set a name");

        // Server streaming, ending with an error status.
        let mut bench = bench::bench_tonic::bench_client::BenchClient::connect(url)
            .await
            .unwrap();
        let echo = bench
            .echo(bench::EchoRequest {
                payload: vec![9u8; 100].into(),
                reply_size: 0,
            })
            .await
            .unwrap();
        assert_eq!(echo.get_ref().payload.len(), 100);
        let mut stream = bench
            .echo_stream(bench::StreamRequest { count: 3, size: 10 })
            .await
            .unwrap()
            .into_inner();
        let mut n = 0;
        let end = loop {
            match stream.message().await {
                Ok(Some(m)) => {
                    assert_eq!(m.payload.len(), 10);
                    n += 1;
                }
                Ok(None) => break None,
                Err(s) => break Some(s),
            }
        };
        assert_eq!(n, 3);
        assert_eq!(end.map(|s| s.code()), Some(tonic::Code::ResourceExhausted));

        // Streaming requests are not adapted yet: UNIMPLEMENTED, with the reason.
        let requests = tokio_stream::iter(vec![bench::EchoRequest::default()]);
        let err = bench.echo_bidi(requests).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unimplemented);
        assert!(err.message().contains("/bench.Bench/EchoBidi"), "{err:?}");

        let _ = stop.send(());
    })
    .await
    .expect("the adapter test took more than 30 s");
}

#[test]
fn codes_map_one_to_one() {
    // Our codes and tonic's share gRPC's numbers.
    for n in 0..=16u8 {
        let ours = Code::from_u8(n);
        assert_eq!(tonic::Code::from(i32::from(n)) as i32, ours as i32);
    }
}
