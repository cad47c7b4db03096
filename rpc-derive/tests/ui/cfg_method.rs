use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    async fn get(&self, request: Msg) -> Result<Msg, Status>;
    #[cfg(any())]
    async fn extra(&self, request: Msg) -> Result<Msg, Status>;
}

fn main() {}
