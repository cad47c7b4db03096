//! A peer's stream coming in: small messages go to the call's inbox as they arrive; a large
//! one (a rendezvous descriptor) is READ into a bulk buffer first, and every frame of the
//! stream that arrives meanwhile is held and delivered after it, in order. Once read, the
//! peer's buffer goes back to it with a BulkRelease.

use crate::queue::ClearIfAny;
use std::collections::VecDeque;

use crate::buf::BulkBuf;
use crate::link::{Control, Link, LinkError};
use crate::streaming::{Inbox, Item};
use crate::verbs::Provider;
use crate::wire::{BulkDesc, CallId};

/// A stream frame that arrived while an earlier one was still being READ.
pub(crate) enum Held {
    /// A message in a receive slot (or copied out of it).
    Item(Item),
    /// A large message to READ from the peer's buffer.
    Bulk(BulkDesc),
    /// A large message of a call that ended: returned unread, in its turn (the peer pairs
    /// releases with what it lent in order). Server side only.
    Release,
    /// The end of the peer's stream. Server side only (a client's stream ends with the
    /// server's status).
    End,
}

/// The incoming stream of one call: the READ of a large message in flight, and the frames
/// held behind it.
pub(crate) struct StreamIn<P: Provider> {
    /// The target of the READ in flight: the NIC's until its completion is polled.
    read: Option<BulkBuf<P>>,
    held: VecDeque<Held>,
}

impl<P: Provider> StreamIn<P> {
    /// No READ in flight, nothing held (no allocation until a frame is held).
    pub(crate) fn new() -> StreamIn<P> {
        StreamIn {
            read: None,
            held: VecDeque::new(),
        }
    }

    /// Back to [`StreamIn::new`] in place (the held queue keeps its capacity). Only for a
    /// record whose READ completed or was parked.
    pub(crate) fn clear(&mut self) {
        self.read = None;
        self.held.clear_if_any();
    }

    /// Whether a stream message is being READ.
    pub(crate) fn reading(&self) -> bool {
        self.read.is_some()
    }

    /// Whether a READ is in flight or frames are held behind one.
    pub(crate) fn busy(&self) -> bool {
        self.read.is_some() || !self.held.is_empty()
    }

    /// Holds `held` behind a READ in flight; gives it back when none is in flight.
    pub(crate) fn hold(&mut self, held: Held) -> Result<(), Held> {
        if self.read.is_some() {
            self.held.push_back(held);
            Ok(())
        } else {
            Err(held)
        }
    }

    /// Delivers a stream frame of `call` (a frame of the `peer`) in order: held behind a READ
    /// in flight, else now ([`StreamIn::deliver`]).
    pub(crate) fn stream_in(
        &mut self,
        link: &mut Link<P>,
        inbox: Option<&Inbox>,
        call: CallId,
        held: Held,
        peer: &str,
    ) -> Result<(), LinkError> {
        match self.hold(held) {
            Ok(()) => Ok(()),
            Err(held) => self.deliver(link, inbox, call, held, peer),
        }
    }

    /// Delivers one frame of `call` now (no READ is in flight): a message to `inbox`, a large
    /// one by posting its READ, the end by finishing the inbox. Without an inbox the call was
    /// given up here (cancelled, expired) while frames were held behind a READ: they are
    /// dropped, and a large message's buffer goes back to the peer unread.
    ///
    /// # Errors
    /// The peer overran its stream window, no buffer for a large message, or the link failed.
    pub(crate) fn deliver(
        &mut self,
        link: &mut Link<P>,
        inbox: Option<&Inbox>,
        call: CallId,
        held: Held,
        peer: &str,
    ) -> Result<(), LinkError> {
        let Some(inbox) = inbox else {
            if let Held::Bulk(_) | Held::Release = held {
                link.control(Control::BulkRelease(call))?;
            }
            return Ok(());
        };
        match held {
            Held::Release => link.control(Control::BulkRelease(call))?,
            Held::Item(item) => push(inbox, item, peer)?,
            Held::End => inbox.finish(None),
            Held::Bulk(desc) => {
                let mut buf = link.bulk.get(desc.len as usize).map_err(|e| {
                    LinkError::Protocol(format!("no buffer for a {}-byte message: {e}", desc.len))
                })?;
                buf.set_len(desc.len as usize);
                // SAFETY: `buf` stays in `self.read` until the READ's successful completion
                // is polled ([`StreamIn::read_done`]), or in the link's graveyard
                // ([`StreamIn::park`]) until the QPs are destroyed; nothing touches it
                // meanwhile.
                if let Err(e) = unsafe { link.post_read(call.slot(), &buf, desc) } {
                    // Part of it may be posted: the NIC's until the QPs are gone.
                    link.park(buf);
                    return Err(e);
                }
                self.read = Some(buf);
            }
        }
        Ok(())
    }

    /// The READ in flight completed successfully: its message goes to `inbox`, the peer's
    /// buffer back to it, and what waited behind it is delivered, until the next READ or the
    /// end of what was held. Returns whether no READ is in flight afterwards; false with
    /// nothing done when no READ was in flight.
    ///
    /// # Errors
    /// As [`StreamIn::deliver`].
    pub(crate) fn read_done(
        &mut self,
        link: &mut Link<P>,
        inbox: Option<&Inbox>,
        call: CallId,
        peer: &str,
    ) -> Result<bool, LinkError> {
        let Some(buf) = self.read.take() else {
            return Ok(false);
        };
        if let Some(inbox) = inbox {
            push(inbox, Item::owned(Box::new(buf)), peer)?;
        }
        link.control(Control::BulkRelease(call))?;
        while self.read.is_none()
            && let Some(h) = self.held.pop_front()
        {
            self.deliver(link, inbox, call, h, peer)?;
        }
        Ok(self.read.is_none())
    }

    /// Moves the target of the READ in flight into `link`'s graveyard (freed only once the
    /// QPs are destroyed): for a record reused or closed while it is posted. Returns whether
    /// there was one (its completion then finds nothing to fill).
    pub(crate) fn park(&mut self, link: &mut Link<P>) -> bool {
        match self.read.take() {
            Some(b) => {
                link.park(b);
                true
            }
            None => false,
        }
    }
}

/// Puts a message in the inbox of a stream of the `peer`.
fn push(inbox: &Inbox, item: Item, peer: &str) -> Result<(), LinkError> {
    inbox
        .push(item)
        .map_err(|_| LinkError::Protocol(format!("{peer} exceeded its stream window")))
}
