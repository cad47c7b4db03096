use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Generic<T> {
    async fn get(&self, request: Msg) -> Result<Msg, Status>;
}

#[rpc_derive::service]
pub trait GenericMethod {
    async fn get<M: prost::Message>(&self, request: M) -> Result<Msg, Status>;
}

fn main() {}
