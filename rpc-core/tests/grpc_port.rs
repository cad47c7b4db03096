//! gRPC on the bootstrap port (feature `grpc`): one bound port serves our RDMA clients and
//! plain gRPC clients (tonic over TCP): `grpc.health.v1` per service and for the server,
//! `NOT_SERVING` during the drain, reflection over a registered descriptor set, and strangers
//! refused without disturbing either kind. Soft provider (whatever `RPC_PROVIDER` names);
//! every wait bounded.
//!
//! A tonic client calling an `emit_tonic` service on the same port is in
//! `rpc-codegen/check/tests/grpc_port.rs` (this crate's tests cannot use generated code).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::OnceLock;
use std::time::Duration;

use common::{Blob, SleepRequest, TestServer, lab_server, wait_until, within};
use prost::Message as _;
use rpc_core::{Channel, ClientPoller, Code, Request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

const LIMIT: Duration = Duration::from_secs(30);

/// A descriptor set for `lab.proto`: the `lab.Lab` service the test server offers (over RDMA)
/// and `lab.Unserved`, which it does not.
fn lab_descriptors() -> &'static [u8] {
    static SET: OnceLock<Vec<u8>> = OnceLock::new();
    SET.get_or_init(|| {
        use prost_types::{
            DescriptorProto, FieldDescriptorProto, FileDescriptorProto, FileDescriptorSet,
            MethodDescriptorProto, ServiceDescriptorProto, field_descriptor_proto::Type,
        };
        let method = |name: &str| MethodDescriptorProto {
            name: Some(name.into()),
            input_type: Some(".lab.Blob".into()),
            output_type: Some(".lab.Blob".into()),
            ..Default::default()
        };
        let file = FileDescriptorProto {
            name: Some("lab.proto".into()),
            package: Some("lab".into()),
            syntax: Some("proto3".into()),
            message_type: vec![DescriptorProto {
                name: Some("Blob".into()),
                field: vec![FieldDescriptorProto {
                    name: Some("seq".into()),
                    number: Some(1),
                    r#type: Some(Type::Uint64 as i32),
                    json_name: Some("seq".into()),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            service: vec![
                ServiceDescriptorProto {
                    name: Some("Lab".into()),
                    method: vec![method("Echo"), method("Sleep")],
                    ..Default::default()
                },
                ServiceDescriptorProto {
                    name: Some("Unserved".into()),
                    method: vec![method("Nothing")],
                    ..Default::default()
                },
            ],
            ..Default::default()
        };
        FileDescriptorSet { file: vec![file] }.encode_to_vec()
    })
}

async fn server() -> TestServer {
    TestServer::start_with(|b| {
        b.register_file_descriptor_set(lab_descriptors())
            .shutdown_grace(Duration::from_secs(20))
    })
    .await
}

async fn grpc_channel(srv: &TestServer) -> tonic::transport::Channel {
    let url = format!("http://{}", srv.addr());
    within(
        LIMIT,
        "gRPC connect",
        tonic::transport::Endpoint::from_shared(url)
            .unwrap()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(10))
            .connect(),
    )
    .await
    .expect("a tonic channel connects to the bootstrap port")
}

async fn health(ch: &tonic::transport::Channel, service: &str) -> Result<ServingStatus, Code> {
    let r: Result<tonic::Response<HealthCheckResponse>, tonic::Status> = within(
        LIMIT,
        "health check",
        HealthClient::new(ch.clone()).check(HealthCheckRequest {
            service: service.into(),
        }),
    )
    .await;
    match r {
        Ok(r) => Ok(r.into_inner().status()),
        Err(s) => Err(Code::from_u8(s.code() as u8)),
    }
}

async fn echo(ch: &Channel, seq: u64) -> Result<u64, rpc_core::Status> {
    let blob = Blob {
        seq,
        data: bytes::Bytes::from_static(b"over rdma"),
    };
    let mut req = Request::new(blob);
    req.set_timeout(Duration::from_secs(20));
    let r = within(LIMIT, "echo", ch.unary::<_, Blob>(&lab_server::ECHO, req)).await?;
    Ok(r.into_inner().seq)
}

/// One reflection request, its one response.
async fn reflect(ch: &tonic::transport::Channel, req: MessageRequest) -> MessageResponse {
    let mut client = ServerReflectionClient::new(ch.clone());
    let requests = futures_util::stream::iter(vec![ServerReflectionRequest {
        host: String::new(),
        message_request: Some(req),
    }]);
    let mut responses = within(LIMIT, "reflection", client.server_reflection_info(requests))
        .await
        .expect("reflection call")
        .into_inner();
    within(LIMIT, "reflection response", responses.message())
        .await
        .expect("reflection response")
        .expect("one response")
        .message_response
        .expect("a message response")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_and_grpc_health_share_the_port() {
    let srv = server().await;
    let ch = srv.channel(ClientPoller::Thread).await;
    assert_eq!(echo(&ch, 7).await.unwrap(), 7, "an RDMA call works");

    let grpc = grpc_channel(&srv).await;
    assert_eq!(health(&grpc, "").await, Ok(ServingStatus::Serving));
    assert_eq!(health(&grpc, "lab.Lab").await, Ok(ServingStatus::Serving));
    assert_eq!(
        health(&grpc, "no.Such").await,
        Err(Code::NotFound),
        "an unknown service is NOT_FOUND, as the health protocol says"
    );
    // Both kinds at once on the same port.
    assert_eq!(echo(&ch, 8).await.unwrap(), 8);
    assert_eq!(
        srv.server.connections(),
        1,
        "the gRPC client is no RDMA connection"
    );

    // A status set by the user.
    srv.server.health().set_not_serving("lab.Lab").await;
    assert_eq!(
        health(&grpc, "lab.Lab").await,
        Ok(ServingStatus::NotServing)
    );
    srv.server.health().set_serving("lab.Lab").await;
    assert_eq!(health(&grpc, "lab.Lab").await, Ok(ServingStatus::Serving));
    within(LIMIT, "shutdown", srv.server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_is_not_serving_while_the_server_drains() {
    let srv = server().await;
    let ch = srv.channel(ClientPoller::Thread).await;
    let grpc = grpc_channel(&srv).await;
    assert_eq!(health(&grpc, "").await, Ok(ServingStatus::Serving));

    // A call in flight keeps the drain open for about 3 s.
    let call = {
        let ch = ch.clone();
        tokio::spawn(async move {
            let mut req = Request::new(SleepRequest {
                seq: 1,
                ms: 3000,
                reply_len: 8,
                pad: bytes::Bytes::new(),
            });
            req.set_timeout(Duration::from_secs(25));
            ch.unary::<_, Blob>(&lab_server::SLEEP, req).await
        })
    };
    let state = std::sync::Arc::clone(&srv.state);
    wait_until(LIMIT, "the handler started", || state.sleeping() >= 1).await;
    let TestServer { server, .. } = srv;
    let addr = server.local_addr();
    let shutdown = tokio::spawn(server.shutdown());

    // The connection opened before, and a new one (a kubelet probe connects each time).
    let mut seen = None;
    for _ in 0..200 {
        match health(&grpc, "").await {
            Ok(ServingStatus::Serving) => tokio::time::sleep(Duration::from_millis(5)).await,
            other => {
                seen = Some(other);
                break;
            }
        }
    }
    assert_eq!(seen, Some(Ok(ServingStatus::NotServing)));
    assert_eq!(
        health(&grpc, "lab.Lab").await,
        Ok(ServingStatus::NotServing)
    );
    let fresh = within(
        LIMIT,
        "gRPC connect during the drain",
        tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .timeout(Duration::from_secs(10))
            .connect(),
    )
    .await
    .expect("the port accepts gRPC while draining");
    assert_eq!(health(&fresh, "").await, Ok(ServingStatus::NotServing));
    assert_eq!(
        health(&fresh, "lab.Lab").await,
        Ok(ServingStatus::NotServing)
    );
    assert!(
        !shutdown.is_finished(),
        "the drain was still open when health said NOT_SERVING"
    );
    // A new RDMA client is refused while the drain runs.
    let refused = within(
        LIMIT,
        "connect during the drain",
        Channel::connect(addr.to_string()),
    )
    .await
    .expect_err("no new RDMA connection while draining");
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");

    within(LIMIT, "shutdown", shutdown).await.unwrap();
    let reply = within(LIMIT, "the call in flight", call).await.unwrap();
    assert_eq!(reply.expect("the call in flight finished").get_ref().seq, 1);
    // Closed: the gRPC side is gone with the rest.
    assert!(health(&grpc, "").await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_the_services_and_serves_their_files() {
    let srv = server().await;
    let grpc = grpc_channel(&srv).await;
    let MessageResponse::ListServicesResponse(list) =
        reflect(&grpc, MessageRequest::ListServices(String::new())).await
    else {
        panic!("not a list");
    };
    let mut names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
            "lab.Lab",
        ],
        "what the server offers and a descriptor describes; not lab.Unserved"
    );

    let MessageResponse::FileDescriptorResponse(files) = reflect(
        &grpc,
        MessageRequest::FileContainingSymbol("lab.Lab.Echo".into()),
    )
    .await
    else {
        panic!("not a file");
    };
    let file = prost_types::FileDescriptorProto::decode(&files.file_descriptor_proto[0][..])
        .expect("a file descriptor");
    assert_eq!(file.name(), "lab.proto");
    assert!(file.service.iter().any(|s| s.name() == "Lab"));

    // The health service describes itself too (grpcurl describe grpc.health.v1.Health).
    let MessageResponse::FileDescriptorResponse(files) = reflect(
        &grpc,
        MessageRequest::FileContainingSymbol("grpc.health.v1.Health".into()),
    )
    .await
    else {
        panic!("not a file");
    };
    assert!(!files.file_descriptor_proto.is_empty());
    within(LIMIT, "shutdown", srv.server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_are_refused_and_the_port_keeps_serving_both() {
    let srv = server().await;
    let addr = srv.server.local_addr();

    // Garbage: the handshake's refusal, then the server closes.
    let mut s = within(LIMIT, "tcp", tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    within(LIMIT, "refusal", s.read_to_end(&mut got))
        .await
        .expect("the refusal, then a clean close (not a reset)");
    let len = u32::from_le_bytes(got[..4].try_into().unwrap()) as usize;
    let msg = rpc_core::testing::Handshake::decode(&got[4..4 + len]).unwrap();
    let rpc_core::testing::Handshake::Refusal(r) = msg else {
        panic!("not a refusal: {msg:?}");
    };
    assert!(r.reason.contains("not an rdma-rpc endpoint"), "{r:?}");

    // Part of the HTTP/2 preface, then the peer leaves: closed, nothing held.
    let mut s = within(LIMIT, "tcp", tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();
    s.write_all(b"PRI * HTTP").await.unwrap();
    drop(s);
    // A preface with garbage after it: hyper refuses it, the server stays up.
    let mut s = within(LIMIT, "tcp", tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\xff\xff\xff\xff\xff\xff\xff\xff\xff")
        .await
        .unwrap();
    let mut sink = Vec::new();
    let _ = within(LIMIT, "hyper closes", s.read_to_end(&mut sink)).await;
    // A peer that connects and says nothing does not block the others.
    let _silent = within(LIMIT, "tcp", tokio::net::TcpStream::connect(addr))
        .await
        .unwrap();

    let ch = srv.channel(ClientPoller::Thread).await;
    assert_eq!(echo(&ch, 3).await.unwrap(), 3);
    let grpc = grpc_channel(&srv).await;
    assert_eq!(health(&grpc, "lab.Lab").await, Ok(ServingStatus::Serving));
    wait_until(LIMIT, "the refused connections are gone", || {
        srv.server.connections() == 1
    })
    .await;
    within(LIMIT, "shutdown", srv.server.shutdown()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_descriptor_set_or_a_duplicate_service_is_a_config_error() {
    let e = rpc_core::Server::builder()
        .register_file_descriptor_set(b"\xff\xff not a descriptor set")
        .bind("127.0.0.1:0")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("FileDescriptorSet"), "{e}");
    let (_, health_server) = tonic_health::server::health_reporter();
    let e = rpc_core::Server::builder()
        .add_grpc_service(health_server)
        .bind("127.0.0.1:0")
        .await
        .unwrap_err();
    assert!(e.to_string().contains("served by the server itself"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_sees_not_serving_and_cannot_hold_the_shutdown() {
    let srv = TestServer::start_with(|b| b.shutdown_grace(Duration::from_millis(300))).await;
    let grpc = grpc_channel(&srv).await;
    let mut watch = within(
        LIMIT,
        "watch",
        HealthClient::new(grpc.clone()).watch(HealthCheckRequest {
            service: "lab.Lab".into(),
        }),
    )
    .await
    .expect("watch starts")
    .into_inner();
    let first = within(LIMIT, "first status", watch.message()).await;
    assert_eq!(
        first.unwrap().unwrap().status(),
        ServingStatus::Serving,
        "the watch starts SERVING"
    );
    let start = std::time::Instant::now();
    let shutdown = tokio::spawn(srv.server.shutdown());
    let next = within(LIMIT, "status at the drain", watch.message()).await;
    assert_eq!(next.unwrap().unwrap().status(), ServingStatus::NotServing);
    // The stream never ends by itself: the server closes its connection after the grace.
    within(LIMIT, "shutdown", shutdown).await.unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "an open watch held the shutdown for {:?}",
        start.elapsed()
    );
    let end = within(LIMIT, "the watch ends", watch.message()).await;
    assert!(!matches!(end, Ok(Some(_))), "{end:?}");
}
