use futures_core::Stream;
use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    type NoBound;
    type Unused: Stream<Item = Result<Msg, Status>>;
    type Fine: Stream<Item = Result<Msg, Status>>;
    async fn unbounded(&self, request: Msg) -> Result<Self::NoBound, Status>;
    async fn missing(&self, request: Msg) -> Result<Self::Missing, Status>;
    async fn fine(&self, request: Msg) -> Result<Self::Fine, Status>;
    const LIMIT: u32;
}

fn main() {}
