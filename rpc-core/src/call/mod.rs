//! The call layer client and server share: what one call of a connection holds between its
//! frames, written once for both sides.
//!
//! - [`record`]: the call table, indexed by the call's wire slot and checked against the
//!   call's id (slot and generation), and the record trait both sides' call records implement;
//! - [`stream`]: a peer's stream coming in, with the frames that arrive while an earlier large
//!   message is still being READ held and delivered in order after it;
//! - [`ledger`]: buffers lent to the peer by key, bound with the least right and released in
//!   the order they were lent;
//! - completion checks ([`send_done`], [`crate::link::completion`]).
//!
//! Whatever the NIC or the peer may still touch when a call's connection ends goes to the
//! link's graveyard ([`Record::park`]), never back to a pool. The layer sits above `link`,
//! `wire` and `buf`, below `client` and `server`.

pub(crate) mod ledger;
pub(crate) mod record;
pub(crate) mod stream;

pub(crate) use ledger::{Ledger, desc, lend_read};
pub(crate) use record::{Calls, Record};
pub(crate) use stream::{Held, StreamIn};

use crate::link::{Link, LinkError, completion};
use crate::verbs::{Provider, Wc};

/// A SEND's completion: the NIC is done with the send slot `slot`, whatever the status, so it
/// goes back to the arena; a failed SEND fails the link.
#[inline]
pub(crate) fn send_done<P: Provider>(
    link: &mut Link<P>,
    wc: &Wc,
    slot: u32,
) -> Result<(), LinkError> {
    link.send_completed(slot);
    completion(wc)
}
