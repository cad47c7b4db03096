//! One implementation of a generated service, served on one port over RDMA (our client) and
//! over plain gRPC (tonic's generated client, TCP), with health and reflection from the
//! descriptor set rpc-codegen wrote. Soft provider; every wait bounded.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use prost::Message as _;
use rpc_codegen_check::helloworld;
use rpc_core::{Request, Response, Server, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const LIMIT: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Greeter {
    calls: AtomicU32,
}

impl helloworld::greeter_server::Greeter for Greeter {
    async fn say_hello(
        &self,
        request: Request<helloworld::HelloRequest>,
    ) -> Result<Response<helloworld::HelloReply>, Status> {
        self.calls.fetch_add(1, Ordering::AcqRel);
        Ok(Response::new(helloworld::HelloReply {
            message: format!("Hello {}!", request.get_ref().name),
        }))
    }
}

async fn reflect(ch: &tonic::transport::Channel, req: MessageRequest) -> MessageResponse {
    let mut client = ServerReflectionClient::new(ch.clone());
    let requests = tokio_stream::iter(vec![ServerReflectionRequest {
        host: String::new(),
        message_request: Some(req),
    }]);
    let mut responses = client
        .server_reflection_info(requests)
        .await
        .unwrap()
        .into_inner();
    responses
        .message()
        .await
        .unwrap()
        .unwrap()
        .message_response
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_implementation_over_rdma_and_grpc_on_one_port() {
    tokio::time::timeout(LIMIT, async {
        let imp = Arc::new(Greeter::default());
        let server = Server::builder()
            .add_service(helloworld::greeter_server::GreeterServer::from_arc(
                Arc::clone(&imp),
            ))
            .add_grpc_service(
                helloworld::greeter_tonic::GreeterTonicAdapter::from_arc(Arc::clone(&imp))
                    .into_service(),
            )
            .register_file_descriptor_set(rpc_codegen_check::FILE_DESCRIPTOR_SET)
            .bind("127.0.0.1:0")
            .await
            .unwrap();
        let addr = server.local_addr();

        // Over RDMA, with our generated client.
        let rdma = helloworld::greeter_client::GreeterClient::connect(addr.to_string())
            .await
            .unwrap();
        let reply = rdma
            .say_hello(helloworld::HelloRequest {
                name: "rdma".into(),
            })
            .await
            .unwrap();
        assert_eq!(reply.get_ref().message, "Hello rdma!");

        // Over TCP, with tonic's generated client, on the same port.
        let url = format!("http://{addr}");
        let grpc = tonic::transport::Endpoint::from_shared(url)
            .unwrap()
            .timeout(Duration::from_secs(20))
            .connect()
            .await
            .unwrap();
        let mut tonic_client =
            helloworld::greeter_tonic::greeter_client::GreeterClient::new(grpc.clone());
        let reply = tonic_client
            .say_hello(helloworld::HelloRequest { name: "tcp".into() })
            .await
            .unwrap();
        assert_eq!(reply.get_ref().message, "Hello tcp!");
        assert_eq!(imp.calls.load(Ordering::Acquire), 2, "one implementation");

        // Health: the service (offered both ways, one name) and the server.
        let mut health = HealthClient::new(grpc.clone());
        for service in ["", "helloworld.Greeter"] {
            let r = health
                .check(tonic_health::pb::HealthCheckRequest {
                    service: service.into(),
                })
                .await
                .unwrap();
            assert_eq!(r.get_ref().status(), ServingStatus::Serving, "{service:?}");
        }

        // Reflection from the descriptor set rpc-codegen wrote: what the server offers, not
        // every service the set describes.
        let MessageResponse::ListServicesResponse(list) =
            reflect(&grpc, MessageRequest::ListServices(String::new())).await
        else {
            panic!("not a list");
        };
        let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"helloworld.Greeter"), "{names:?}");
        assert!(names.contains(&"grpc.health.v1.Health"), "{names:?}");
        assert!(!names.contains(&"bench.Bench"), "{names:?}");
        let MessageResponse::FileDescriptorResponse(files) = reflect(
            &grpc,
            MessageRequest::FileContainingSymbol("helloworld.Greeter.SayHello".into()),
        )
        .await
        else {
            panic!("not a file");
        };
        let file =
            prost_types::FileDescriptorProto::decode(&files.file_descriptor_proto[0][..]).unwrap();
        assert_eq!(file.name(), "greeter.proto");
        assert_eq!(file.service[0].name(), "Greeter");

        server.shutdown().await;
    })
    .await
    .expect("the test took more than 60 s");
}
