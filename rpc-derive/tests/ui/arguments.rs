use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service(pakage = "x")]
pub trait A {
    async fn get(&self, request: Msg) -> Result<Msg, Status>;
}

#[rpc_derive::service(package = "not a package")]
pub trait B {
    async fn get(&self, request: Msg) -> Result<Msg, Status>;
}

#[rpc_derive::service]
pub struct NotATrait;

fn main() {}
