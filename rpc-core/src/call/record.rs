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
///
/// A table ([`Calls::lazy`]) holds records only up to the highest slot used so far
/// (clients reuse their lowest free slot first), so an idle connection that made a few calls
/// costs a few records, not its peer's whole call table; [`Calls::get_mut`] adds the records
/// up to a new slot (once per slot, not per call).
pub(crate) struct Calls<C> {
    recs: Vec<C>,
    max: usize,
    empty: fn() -> C,
}

impl<C> Calls<C> {
    /// A table of up to `n` records, made as slots are first used.
    pub(crate) fn lazy<P: Provider>(n: usize) -> Calls<C>
    where
        C: Record<P>,
    {
        Calls {
            recs: Vec::new(),
            max: n,
            empty: C::empty,
        }
    }

    /// The record of `slot` (made, with those below it, the first time the slot is used);
    /// `None` beyond the table.
    #[inline]
    pub(crate) fn get_mut(&mut self, slot: usize) -> Option<&mut C> {
        if slot >= self.recs.len() {
            crate::slot_table::grow(&mut self.recs, slot, self.max, self.empty);
        }
        self.recs.get_mut(slot)
    }

    /// The record of `call` if its slot still holds that very call (not an earlier or later
    /// one of the same slot).
    #[inline]
    pub(crate) fn live<P: Provider>(&mut self, call: CallId) -> Option<&mut C>
    where
        C: Record<P>,
    {
        self.recs
            .get_mut(call.slot() as usize)
            .filter(|c| c.id() == call)
    }

    /// Parks every record's buffers the NIC or the peer may still touch ([`Record::park`]).
    pub(crate) fn park_all<P: Provider>(&mut self, link: &mut Link<P>)
    where
        C: Record<P>,
    {
        for c in self.recs.iter_mut() {
            c.park(link);
        }
    }
}

impl<C> std::ops::Deref for Calls<C> {
    type Target = [C];

    fn deref(&self) -> &[C] {
        &self.recs
    }
}

impl<C> std::ops::DerefMut for Calls<C> {
    fn deref_mut(&mut self) -> &mut [C] {
        &mut self.recs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::soft::Soft;

    struct R(CallId);

    impl Record<Soft> for R {
        fn empty() -> R {
            R(CallId(0))
        }
        fn id(&self) -> CallId {
            self.0
        }
        fn reset(&mut self) {
            self.0 = CallId(0);
        }
        fn park(&mut self, _link: &mut Link<Soft>) {}
    }

    /// A lazy table holds records up to the highest slot used, never beyond its size, and a
    /// slot once made keeps its record.
    #[test]
    fn a_lazy_table_grows_to_the_slots_used() {
        let mut t = Calls::<R>::lazy::<Soft>(64);
        assert_eq!(t.len(), 0);
        assert!(t.live::<Soft>(CallId::new(0, 1)).is_none());
        t.get_mut(0).unwrap().0 = CallId::new(0, 1);
        assert_eq!(
            t.len(),
            1,
            "a connection with one call at a time holds one record"
        );
        assert!(t.live::<Soft>(CallId::new(0, 1)).is_some());
        assert!(t.get_mut(2).is_some());
        assert_eq!(t.len(), 3);
        assert!(t.get_mut(3).is_some());
        assert_eq!(t.len(), 6, "at least doubles");
        assert!(t.get_mut(9).is_some());
        assert_eq!(t.len(), 12);
        assert!(t.get_mut(63).is_some());
        assert_eq!(t.len(), 64);
        assert!(t.get_mut(64).is_none(), "beyond the peer's call table");
        assert_eq!(
            t.live::<Soft>(CallId::new(0, 1)).map(|r| r.0),
            Some(CallId::new(0, 1))
        );
    }
}
