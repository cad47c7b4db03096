//! The greeter again, defined as a Rust trait with `#[service]` instead of a `.proto`: same
//! generated client and server, same runtime.
//!
//! ```sh
//! cargo run --release -p rpc-examples --bin greeter_derive
//! ```

use std::time::Duration;

use rpc_core::Status;
use rpc_core::server::Server;

/// Who to greet.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloRequest {
    #[prost(string, tag = "1")]
    pub name: String,
}

/// The greeting.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HelloReply {
    #[prost(string, tag = "1")]
    pub message: String,
}

/// Says hello: path `/helloworld.Greeter/SayHello`, the same as `proto/greeter.proto`'s.
#[rpc_derive::service(package = "helloworld")]
pub trait Greeter {
    /// Sends a greeting.
    async fn say_hello(&self, request: HelloRequest) -> Result<HelloReply, Status>;
}

struct MyGreeter;

impl Greeter for MyGreeter {
    async fn say_hello(&self, request: HelloRequest) -> Result<HelloReply, Status> {
        if request.name.is_empty() {
            return Err(Status::invalid_argument("name must not be empty"));
        }
        Ok(HelloReply {
            message: format!("Hello {}!", request.name),
        })
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    rpc_examples::init_tracing();
    // `MyGreeter` implements the simple trait; `greeter_server::GreeterServer` serves it.
    let server = Server::builder()
        .add_service(greeter_server::GreeterServer::new(MyGreeter))
        .bind("127.0.0.1:0")
        .await?;
    let addr = server.local_addr();
    println!("greeter_derive: server on {addr}");

    let client = greeter_client::GreeterClient::connect(addr.to_string()).await?;
    let reply = client
        .say_hello(HelloRequest {
            name: "trait".into(),
        })
        .await?;
    println!("greeter_derive: say_hello -> {:?}", reply.get_ref().message);

    // The .proto-generated client speaks to the same path: the two definitions are one service.
    let proto_client =
        rpc_examples::helloworld::greeter_client::GreeterClient::new(client.as_ref().clone());
    let reply = proto_client
        .say_hello(rpc_examples::helloworld::HelloRequest {
            name: "proto client".into(),
        })
        .await?;
    println!(
        "greeter_derive: .proto client -> {:?}",
        reply.get_ref().message
    );

    tokio::time::timeout(Duration::from_secs(10), server.shutdown()).await?;
    Ok(())
}
