//! Buffers lent to the peer: each loan is bound for this connection only with the least right
//! its use needs (remote READ for a payload the peer fetches), and ends with the peer's
//! BulkRelease. A peer returns the large stream messages of a call in the order they were
//! lent, so the ledger releases them in that order.

use crate::queue::ClearIfAny;
use std::collections::VecDeque;

use crate::buf::BulkBuf;
use crate::link::Link;
use crate::verbs::{Access, Provider, RemoteMr, VerbsError};
use crate::wire::BulkDesc;

/// The descriptor a frame carries for a loan.
pub(crate) fn desc(r: RemoteMr) -> BulkDesc {
    BulkDesc {
        addr: r.addr,
        len: r.len,
        rkey: r.rkey,
    }
}

/// Lends `buf` to the peer connected to `qp` for reading (a rendezvous payload, a large stream
/// message): the descriptor to send.
///
/// # Errors
/// When the key cannot be bound.
pub(crate) fn lend_read<P: Provider>(
    buf: &mut BulkBuf<P>,
    qp: &P::Qp,
) -> Result<BulkDesc, VerbsError> {
    buf.lend(Access::REMOTE_READ, qp).map(desc)
}

/// The large stream messages of a call lent to the peer, oldest first: dropping one revokes
/// the peer's key.
pub(crate) struct Ledger<P: Provider> {
    lent: VecDeque<BulkBuf<P>>,
}

impl<P: Provider> Ledger<P> {
    /// An empty ledger (no allocation until the first loan).
    pub(crate) fn new() -> Ledger<P> {
        Ledger {
            lent: VecDeque::new(),
        }
    }

    /// Records a loan, after the frame that carries its key was committed.
    pub(crate) fn lend(&mut self, buf: BulkBuf<P>) {
        self.lent.push_back(buf);
    }

    /// The peer's BulkRelease: ends the oldest loan (its key is revoked). False when nothing
    /// of the ledger was lent (the release is for another buffer of the call).
    pub(crate) fn release(&mut self) -> bool {
        self.lent.pop_front().is_some()
    }

    /// Loans open.
    pub(crate) fn len(&self) -> usize {
        self.lent.len()
    }

    /// Whether no loan is open.
    pub(crate) fn is_empty(&self) -> bool {
        self.lent.is_empty()
    }

    /// Ends every loan (the call's slot is reused; keeps the queue's capacity).
    pub(crate) fn clear(&mut self) {
        self.lent.clear_if_any();
    }

    /// Moves the open loans into `link`'s graveyard (the peer may still read them until the
    /// QPs are destroyed).
    pub(crate) fn park(&mut self, link: &mut Link<P>) {
        if !self.lent.is_empty() {
            link.park(std::mem::take(&mut self.lent));
        }
    }
}
