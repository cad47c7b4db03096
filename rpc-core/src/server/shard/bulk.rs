//! Handlers' one-sided bulk operations on a client's registered memory: posted from the
//! queue handlers fill, answered when their completions are polled.

use crate::Status;
use crate::link::{LinkError, LinkKey, WrKind, completion};
use crate::queue::PopIfAny;
use crate::server::peer::{BulkMem, BulkOp, OpKind};
use crate::verbs::{Provider, Wc, WcStatus};

use super::Shard;

/// A handler's bulk operation in flight.
pub(super) struct InflightOp {
    pub(super) key: LinkKey,
    pub(super) local: Box<dyn BulkMem>,
    pub(super) kind: OpKind,
    pub(super) done: tokio::sync::oneshot::Sender<Result<Box<dyn BulkMem>, Status>>,
}

impl<P: Provider> Shard<P> {
    pub(super) fn on_bulk_done(&mut self, wc: &Wc, op: usize) -> Result<(), LinkError> {
        let Some(op) = self.bulk_ops.try_remove(op) else {
            return Ok(());
        };
        let Err(failed) = completion(wc) else {
            let _ = op.done.send(Ok(op.local));
            return Ok(());
        };
        // Failed or flushed: the operation did not happen, and the connection fails. The
        // buffer is not the handler's again: a striped operation may still be in flight on
        // another QP, so it waits in the graveyard until the QPs are destroyed.
        let InflightOp {
            key,
            local,
            kind,
            done,
        } = op;
        match self.conns.get_mut(key.idx as usize) {
            Some(Some(conn)) if conn.link.key() == key => conn.link.park(local),
            // The connection is gone, and with it its QPs: nothing can touch the buffer.
            _ => drop(local),
        }
        let e = crate::verbs::WcError { wc: *wc };
        let what = if kind == OpKind::Read {
            "READ"
        } else {
            "WRITE"
        };
        let code = match wc.status {
            WcStatus::RemAccessErr => {
                Status::permission_denied(format!("bulk {what} of the client's memory: {e}"))
            }
            WcStatus::WrFlushErr => Status::unavailable(format!(
                "bulk {what} not done: the connection had already failed ({e})"
            )),
            _ => Status::unavailable(format!("bulk {what} failed: {e}")),
        };
        let _ = done.send(Err(code));
        Err(failed)
    }

    /// Posts the bulk operations handlers queued.
    pub(super) fn start_bulk_ops(&mut self) -> usize {
        let mut n = 0;
        while let Some(op) = self.peer_api.ops.pop_if_any() {
            n += 1;
            let BulkOp {
                key,
                call,
                kind,
                remote,
                local,
                len,
                done,
            } = op;
            let idx = key.idx as usize;
            self.touch(idx);
            let Some(Some(conn)) = self.conns.get_mut(idx) else {
                let _ = done.send(Err(Status::unavailable("the connection is closed")));
                continue;
            };
            if conn.link.key() != key {
                let _ = done.send(Err(Status::unavailable("the connection is closed")));
                continue;
            }
            if !conn.slot(call).is_some_and(|c| c.active) {
                let _ = done.send(Err(Status::failed_precondition(
                    "the call has ended: a handler reaches the client's memory only while its \
                     call runs",
                )));
                continue;
            }
            let entry = self.bulk_ops.vacant_entry();
            let aux = entry.key() as u32;
            // SAFETY: `local` is kept in `bulk_ops` until the operation's successful completion
            // is polled (a failed one, a failed post, or the connection's close park it in the
            // link's graveyard until the QPs are destroyed), untouched meanwhile.
            let r = unsafe {
                conn.link.post_one_sided(
                    WrKind::Bulk,
                    aux,
                    |off, l| local.sge(off, l),
                    remote,
                    len,
                    kind == OpKind::Write,
                )
            };
            match r {
                Ok(()) => {
                    entry.insert(InflightOp {
                        key,
                        local,
                        kind,
                        done,
                    });
                }
                Err(e) => {
                    // Some chunks may be posted (the link then failed its QPs).
                    conn.link.park(local);
                    let _ = done.send(Err(Status::unavailable(format!("bulk operation: {e}"))));
                }
            }
        }
        n
    }
}
