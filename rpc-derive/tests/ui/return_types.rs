use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    async fn nothing(&self, request: Msg);
    async fn bare(&self, request: Msg) -> Msg;
    async fn other_error(&self, request: Msg) -> Result<Msg, String>;
}

fn main() {}
