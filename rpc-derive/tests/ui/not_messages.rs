use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    async fn text(&self, request: &str) -> Result<String, Status>;
    async fn bytes(&self, request: Vec<u8>) -> Result<Msg, Status>;
    async fn pair(&self, request: (Msg, Msg)) -> Result<Option<Msg>, Status>;
    async fn number(&self, request: u64) -> Result<Msg, Status>;
}

fn main() {}
