use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    #[rpc(idempotnt)]
    async fn misspelt(&self, request: Msg) -> Result<Msg, Status>;
    #[rpc(idempotent, no_side_effects)]
    async fn both(&self, request: Msg) -> Result<Msg, Status>;
    #[rpc(idempotent = true)]
    async fn valued(&self, request: Msg) -> Result<Msg, Status>;
    #[rpc(no_side_effects)]
    async fn fine(&self, request: Msg) -> Result<Msg, Status>;
}

fn main() {}
