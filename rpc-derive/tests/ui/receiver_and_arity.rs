use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    async fn mutable(&mut self, request: Msg) -> Result<Msg, Status>;
    async fn by_value(self, request: Msg) -> Result<Msg, Status>;
    async fn no_self(request: Msg) -> Result<Msg, Status>;
    async fn nothing(&self) -> Result<Msg, Status>;
    async fn two(&self, a: Msg, b: Msg) -> Result<Msg, Status>;
}

fn main() {}
