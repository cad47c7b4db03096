use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    fn get(&self, request: Msg) -> Result<Msg, Status>;
    async fn fine(&self, request: Msg) -> Result<Msg, Status>;
    const unsafe fn worse(&self, request: Msg) -> Result<Msg, Status>;
}

fn main() {}
