//! The call table of a connection: one record per wire call slot, reused in place from call to
//! call (a record is large: building and moving a whole one per call showed up as memcpy), and
//! looked up by [`CallId`], whose generation tells a late frame of an earlier call in the same
//! slot from one of the current call.

use crate::link::Link;
use crate::verbs::Provider;
use crate::wire::CallId;

/// A call record of one side (the client's driver, a server connection).
pub(crate) trait Record<P: Provider> {
    /// A record of no call.
    fn empty() -> Self;

    /// The call the record holds (`CallId(0)`: none).
    fn id(&self) -> CallId;

    /// Back to [`Record::empty`] in place: buffers and streams dropped, queues emptied
    /// (keeping their capacity).
    fn reset(&mut self);

    /// Moves everything of the record that the NIC or the peer may still touch (READ targets,
    /// WRITE sources, buffers lent by key) into `link`'s graveyard, freed only once the link's
    /// QPs are destroyed: for a connection whose completions will not be polled any more.
    fn park(&mut self, link: &mut Link<P>);
}

/// The records of a connection's calls, indexed by wire call slot.
pub(crate) struct Calls<C>(Box<[C]>);

impl<C> Calls<C> {
    /// A table of `n` empty records.
    pub(crate) fn new<P: Provider>(n: usize) -> Calls<C>
    where
        C: Record<P>,
    {
        Calls((0..n).map(|_| C::empty()).collect())
    }

    /// The record of `call` if its slot still holds that very call (not an earlier or later
    /// one of the same slot).
    #[inline]
    pub(crate) fn live<P: Provider>(&mut self, call: CallId) -> Option<&mut C>
    where
        C: Record<P>,
    {
        self.0
            .get_mut(call.slot() as usize)
            .filter(|c| c.id() == call)
    }

    /// Parks every record's buffers the NIC or the peer may still touch ([`Record::park`]).
    pub(crate) fn park_all<P: Provider>(&mut self, link: &mut Link<P>)
    where
        C: Record<P>,
    {
        for c in self.0.iter_mut() {
            c.park(link);
        }
    }
}

impl<C> std::ops::Deref for Calls<C> {
    type Target = [C];

    fn deref(&self) -> &[C] {
        &self.0
    }
}

impl<C> std::ops::DerefMut for Calls<C> {
    fn deref_mut(&mut self) -> &mut [C] {
        &mut self.0
    }
}
