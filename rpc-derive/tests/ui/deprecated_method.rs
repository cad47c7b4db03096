#![deny(warnings)]

use rpc_core::Status;

#[derive(Clone, PartialEq, prost::Message)]
pub struct Msg {}

#[rpc_derive::service]
pub trait Svc {
    /// Declaring a deprecated method warns nobody; calling it does.
    #[deprecated]
    async fn old(&self, request: Msg) -> Result<Msg, Status>;
    async fn new_one(&self, request: Msg) -> Result<Msg, Status>;
}

#[allow(dead_code)]
async fn caller(client: svc_client::SvcClient) {
    let _ = client.old(Msg {}).await;
}

fn main() {}
