use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc
where
    Msg: Clone,
{
    async fn get(&self, request: Msg) -> Result<Msg, Status>
    where
        Msg: Clone;
}

fn main() {}
