use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    async fn connect(&self, request: Msg) -> Result<Msg, Status>;
    async fn new(&self, request: Msg) -> Result<Msg, Status>;
    async fn get(&self, request: Msg) -> Result<Msg, Status>;
    async fn get_x(&self, request: Msg) -> Result<Msg, Status>;
    #[allow(non_snake_case)]
    async fn getX(&self, request: Msg) -> Result<Msg, Status>;
}

fn main() {}
