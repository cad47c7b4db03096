//! Tables indexed by call slot that hold entries only up to the highest slot used so far: a
//! client takes its lowest free slot first, so a connection with a few calls in flight holds
//! a few entries, not its whole call limit's worth. They grow the first times a higher slot
//! comes (at least doubling, so a few times in a connection's life), never per call.

/// The length a slot table `len` long grows to for `slot`, at most `max`: at least doubled.
pub(crate) fn grown_len(len: usize, slot: usize, max: usize) -> usize {
    (slot + 1).max(len * 2).min(max)
}

/// Grows `table` with entries made by `fill` to cover `slot` (see [`grown_len`]); nothing
/// for a slot at or beyond `max`.
#[cold]
pub(crate) fn grow<T>(table: &mut Vec<T>, slot: usize, max: usize, fill: impl FnMut() -> T) {
    let want = grown_len(table.len(), slot, max);
    if want > table.len() {
        table.reserve_exact(want - table.len());
        table.resize_with(want, fill);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_to_the_slot_at_least_doubling_up_to_the_max() {
        let mut t: Vec<u8> = Vec::new();
        grow(&mut t, 0, 8, || 7);
        assert_eq!(t, [7]);
        grow(&mut t, 2, 8, || 7);
        assert_eq!(t.len(), 3);
        grow(&mut t, 3, 8, || 7);
        assert_eq!(t.len(), 6, "at least doubles");
        grow(&mut t, 7, 8, || 7);
        assert_eq!(t.len(), 8, "never beyond the max");
        grow(&mut t, 9, 8, || 7);
        assert_eq!(t.len(), 8);
    }
}
