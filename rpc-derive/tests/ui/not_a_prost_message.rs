use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

/// Has the shape of a message, but is not one.
pub struct NotMsg;

#[rpc_derive::service]
pub trait Svc {
    async fn get(&self, request: NotMsg) -> Result<Msg, Status>;
}

fn main() {}
