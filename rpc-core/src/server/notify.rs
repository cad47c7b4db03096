//! The shard's side of its doorbell ([`crate::doorbell`]): what wakes it for a handler task.

use std::sync::Arc;

use crate::buf::Notify;
use crate::doorbell::Doorbell;

/// The shard's wake notifier: rings the shard's doorbell.
#[derive(Debug, Clone)]
pub struct ShardNotify(pub Arc<Doorbell>);

impl Notify for ShardNotify {
    fn notify(&self) {
        self.0.ring();
    }
}
