//! Encoding prost messages straight into registered memory.

use prost::Message;

/// A message that can be encoded into a byte slice: object-safe, so the runtime can take any
/// prost message without being generic over it.
pub trait EncodeMsg: Send + Sync {
    /// Exact encoded length.
    fn encoded_len(&self) -> usize;

    /// Encodes into `out[..self.encoded_len()]`; returns the bytes written, or `None` (writing
    /// nothing) when `out` is too small.
    fn encode_into(&self, out: &mut [u8]) -> Option<usize>;

    /// Encodes into `out`, which is exactly [`EncodeMsg::encoded_len`] bytes (the caller
    /// measured it): [`EncodeMsg::encode_into`] without measuring again. Returns the bytes
    /// written.
    fn encode_measured(&self, out: &mut [u8]) -> Option<usize> {
        self.encode_into(out)
    }

    /// Encodes through a [`Gather`]: large `bytes` fields that already lie in the gather's
    /// registered region are referenced, not copied. Returns `None` when the staging area is
    /// too small ([`Gather::needed`] then says how much would do). The default copies
    /// everything (it is [`EncodeMsg::encode_into`]).
    fn encode_gather(&self, g: &mut Gather<'_>) -> Option<()> {
        let n = self.encode_into(g.rest())?;
        g.staged(n);
        Some(())
    }
}

impl<M: Message> EncodeMsg for M {
    fn encoded_len(&self) -> usize {
        Message::encoded_len(self)
    }

    fn encode_into(&self, out: &mut [u8]) -> Option<usize> {
        let len = Message::encoded_len(self);
        let mut w = Out(out.get_mut(..len)?);
        self.encode_raw(&mut w);
        debug_assert!(
            w.0.is_empty(),
            "prost encoded_len disagrees with encode_raw"
        );
        Some(len - w.0.len())
    }

    fn encode_measured(&self, out: &mut [u8]) -> Option<usize> {
        let len = out.len();
        let mut w = Out(out);
        // A message's length does not change between two calls on `&self`: `out` fits.
        self.encode_raw(&mut w);
        Some(len - w.0.len())
    }

    fn encode_gather(&self, g: &mut Gather<'_>) -> Option<()> {
        // The staging area may be smaller than the message (only its unreferenced part is
        // staged): a `Gather` that runs out counts instead of writing.
        self.encode_raw(g);
        (!g.overflowed()).then_some(())
    }
}

/// One piece of a gathered encoding, in message order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Piece {
    /// `len` bytes written into the staging area at `offset`.
    Staged {
        /// Offset in the staging area.
        offset: usize,
        /// Length.
        len: usize,
    },
    /// `len` bytes left where they are, at `offset` in the gather's region.
    Region {
        /// Offset in the region.
        offset: usize,
        /// Length.
        len: usize,
    },
}

/// Most pieces a gathered encoding is made of (staged and referenced alternate, so at most
/// `(MAX_PIECES - 1) / 2` references).
pub const MAX_PIECES: usize = 3;

/// A `bytes::BufMut` that encodes a message into a staging area, except that a contiguous
/// slice of at least `min_ref` bytes lying inside `region` (registered memory the caller keeps
/// alive until the NIC has sent it) is recorded as a reference instead of being copied. The
/// result is a list of [`Piece`]s that a gather list of SGEs sends in order.
///
/// prost writes `bytes` fields with `BufMut::put`, everything else with `put_slice`; only
/// `put` looks for references. When the staging area runs out, the rest is counted, not
/// written ([`Gather::overflowed`], [`Gather::needed`]): the caller retries with a larger one.
#[derive(Debug)]
pub struct Gather<'a> {
    stage: &'a mut [u8],
    used: usize,
    /// Bytes that did not fit in the staging area (the encoding is incomplete when nonzero).
    lost: usize,
    region: (usize, usize),
    min_ref: usize,
    pieces: [Piece; MAX_PIECES],
    n: usize,
}

impl<'a> Gather<'a> {
    /// A gather staging into `stage`, referencing slices of at least `min_ref` bytes inside
    /// `region` (an empty region: nothing is referenced).
    pub fn new(stage: &'a mut [u8], region: &[u8], min_ref: usize) -> Gather<'a> {
        Gather {
            stage,
            used: 0,
            lost: 0,
            region: (region.as_ptr() as usize, region.len()),
            min_ref: min_ref.max(1),
            pieces: [Piece::Staged { offset: 0, len: 0 }; MAX_PIECES],
            n: 0,
        }
    }

    /// A gather staging into `stage` that references every slice of at least `min_ref`
    /// bytes, wherever it lies: [`Piece::Region`]'s offset is then the slice's address (the
    /// caller copies those pieces itself, for example a chunk at a time).
    pub fn anywhere(stage: &'a mut [u8], min_ref: usize) -> Gather<'a> {
        Gather {
            region: (0, usize::MAX),
            ..Gather::new(stage, &[], min_ref)
        }
    }

    /// The pieces, in order.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces[..self.n]
    }

    /// Bytes of the message so far, staged and referenced.
    pub fn len(&self) -> usize {
        self.pieces()
            .iter()
            .map(|p| match *p {
                Piece::Staged { len, .. } | Piece::Region { len, .. } => len,
            })
            .sum()
    }

    /// Whether nothing was encoded.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes referenced rather than copied.
    pub fn referenced(&self) -> usize {
        self.pieces()
            .iter()
            .map(|p| match *p {
                Piece::Region { len, .. } => len,
                Piece::Staged { .. } => 0,
            })
            .sum()
    }

    /// Whether the staging area ran out (the pieces are then incomplete).
    pub fn overflowed(&self) -> bool {
        self.lost > 0
    }

    /// Staging bytes this encoding needed: with a staging area this large (and the same
    /// region) it fits.
    pub fn needed(&self) -> usize {
        self.used + self.lost
    }

    /// The unused rest of the staging area.
    pub fn rest(&mut self) -> &mut [u8] {
        &mut self.stage[self.used..]
    }

    /// Records that `n` more bytes were written at the start of [`Gather::rest`].
    pub fn staged(&mut self, n: usize) {
        if n == 0 {
            return;
        }
        let offset = self.used;
        self.used += n;
        if self.n > 0
            && let Piece::Staged { offset: o, len } = &mut self.pieces[self.n - 1]
            && *o + *len == offset
        {
            *len += n;
            return;
        }
        // A reference is pushed only when a slot is left for the staged piece after it.
        debug_assert!(self.n < MAX_PIECES);
        self.pieces[self.n] = Piece::Staged { offset, len: n };
        self.n += 1;
    }

    /// `bytes` as a reference when it lies in the region, is large enough and a piece is left
    /// for it and for a staged piece after it.
    fn try_reference(&mut self, bytes: &[u8]) -> bool {
        let (start, len) = self.region;
        let p = bytes.as_ptr() as usize;
        let inside = p >= start && p - start <= len && bytes.len() <= len - (p - start);
        if bytes.len() < self.min_ref || !inside || self.n + 2 > MAX_PIECES {
            return false;
        }
        self.pieces[self.n] = Piece::Region {
            offset: p - start,
            len: bytes.len(),
        };
        self.n += 1;
        true
    }
}

// SAFETY: `chunk_mut` hands out the unused rest of `stage`, and `advance_mut` (which records
// the bytes as staged) refuses to move past its end: the contract of `BufMut`.
unsafe impl bytes::BufMut for Gather<'_> {
    fn remaining_mut(&self) -> usize {
        self.stage.len() - self.used
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        assert!(
            cnt <= self.remaining_mut(),
            "advance_mut past the staging area"
        );
        self.staged(cnt);
    }

    fn chunk_mut(&mut self) -> &mut bytes::buf::UninitSlice {
        bytes::buf::UninitSlice::new(&mut self.stage[self.used..])
    }

    fn put_slice(&mut self, src: &[u8]) {
        if self.lost > 0 || src.len() > self.remaining_mut() {
            // Out of room: count from here on, write nothing more.
            self.lost += src.len();
            return;
        }
        crate::memcopy::copy(&mut self.rest()[..src.len()], src);
        self.staged(src.len());
    }

    fn put<T: bytes::Buf>(&mut self, src: T)
    where
        Self: Sized,
    {
        for_each_chunk(src, |chunk| {
            if !self.try_reference(chunk) {
                self.put_slice(chunk);
            }
        });
    }
}

/// Hands `src`'s chunks to `f` in order (the `put` of the `BufMut`s here: bytes' own `put`
/// copies through `chunk_mut`, around their `put_slice`).
fn for_each_chunk<T: bytes::Buf>(mut src: T, mut f: impl FnMut(&[u8])) {
    while src.has_remaining() {
        let chunk = src.chunk();
        let n = chunk.len();
        f(chunk);
        src.advance(n);
    }
}

/// The unwritten rest of an output slice, as prost's `BufMut`: `&mut [u8]`'s own, except that
/// fields are copied with [`crate::memcopy`] (a `bytes` field lands a few bytes past where it
/// lies in its source, the distance at which `memcpy` falls off a cliff on some hosts).
struct Out<'a>(&'a mut [u8]);

// SAFETY: `chunk_mut` hands out the unwritten rest, and `advance_mut` refuses to move past
// its end: the contract of `BufMut`.
unsafe impl bytes::BufMut for Out<'_> {
    fn remaining_mut(&self) -> usize {
        self.0.len()
    }

    unsafe fn advance_mut(&mut self, cnt: usize) {
        assert!(cnt <= self.0.len(), "advance_mut past the output");
        let rest = std::mem::take(&mut self.0);
        self.0 = &mut rest[cnt..];
    }

    fn chunk_mut(&mut self) -> &mut bytes::buf::UninitSlice {
        bytes::buf::UninitSlice::new(self.0)
    }

    fn put_slice(&mut self, src: &[u8]) {
        let rest = std::mem::take(&mut self.0);
        assert!(src.len() <= rest.len(), "put_slice past the output");
        let (head, tail) = rest.split_at_mut(src.len());
        crate::memcopy::copy(head, src);
        self.0 = tail;
    }

    fn put<T: bytes::Buf>(&mut self, src: T)
    where
        Self: Sized,
    {
        for_each_chunk(src, |chunk| self.put_slice(chunk));
    }
}

/// A message with nothing in it (for frames that carry no payload).
#[derive(Clone, Copy, Debug, Default)]
pub struct NoMsg;

impl EncodeMsg for NoMsg {
    fn encoded_len(&self) -> usize {
        0
    }

    fn encode_into(&self, _out: &mut [u8]) -> Option<usize> {
        Some(0)
    }
}

/// Raw bytes as a payload (status messages).
#[derive(Clone, Copy, Debug)]
pub struct RawBytes<'a>(pub &'a [u8]);

impl EncodeMsg for RawBytes<'_> {
    fn encoded_len(&self) -> usize {
        self.0.len()
    }

    fn encode_into(&self, out: &mut [u8]) -> Option<usize> {
        let dst = out.get_mut(..self.0.len())?;
        crate::memcopy::copy(dst, self.0);
        Some(self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, PartialEq, prost::Message)]
    struct M {
        #[prost(string, tag = "1")]
        s: String,
    }

    #[derive(Clone, PartialEq, prost::Message)]
    struct Blob {
        #[prost(uint64, tag = "1")]
        seq: u64,
        #[prost(bytes = "bytes", tag = "2")]
        data: bytes::Bytes,
        #[prost(string, tag = "3")]
        note: String,
    }

    /// The pieces, put together, are the message's encoding.
    fn assemble(pieces: &[Piece], stage: &[u8], region: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for p in pieces {
            match *p {
                Piece::Staged { offset, len } => {
                    out.extend_from_slice(&stage[offset..offset + len])
                }
                Piece::Region { offset, len } => {
                    out.extend_from_slice(&region[offset..offset + len])
                }
            }
        }
        out
    }

    #[test]
    fn gather_references_large_fields_in_the_region_and_copies_the_rest() {
        let region: bytes::Bytes = (0..100_000u32).map(|i| i as u8).collect::<Vec<_>>().into();
        let m = Blob {
            seq: 7,
            data: region.slice(1000..90_000),
            note: "after".into(),
        };
        let mut stage = vec![0u8; Message::encoded_len(&m)];
        let mut g = Gather::new(&mut stage, &region, 4096);
        EncodeMsg::encode_gather(&m, &mut g).unwrap();
        assert_eq!(g.referenced(), 89_000);
        assert_eq!(g.len(), Message::encoded_len(&m));
        assert_eq!(g.pieces().len(), 3);
        assert_eq!(
            g.pieces()[1],
            Piece::Region {
                offset: 1000,
                len: 89_000
            }
        );
        let pieces = g.pieces().to_vec();
        assert_eq!(assemble(&pieces, &stage, &region), m.encode_to_vec());
    }

    #[test]
    fn gather_anywhere_references_large_fields_by_address() {
        let data: bytes::Bytes = vec![3u8; 40_000].into();
        let m = Blob {
            seq: 9,
            data: data.clone(),
            note: "n".repeat(20),
        };
        let mut stage = [0u8; 256];
        let mut g = Gather::anywhere(&mut stage, 30_000);
        EncodeMsg::encode_gather(&m, &mut g).unwrap();
        assert_eq!(g.len(), Message::encoded_len(&m));
        assert_eq!(g.referenced(), 40_000);
        let pieces = g.pieces().to_vec();
        let at = pieces
            .iter()
            .position(|p| matches!(p, Piece::Region { .. }))
            .unwrap();
        assert_eq!(
            pieces[at],
            Piece::Region {
                offset: data.as_ptr() as usize,
                len: 40_000
            }
        );
        // Staged before and after it, in order, make the encoding with the field between.
        let mut out = Vec::new();
        for p in &pieces {
            match *p {
                Piece::Staged { offset, len } => {
                    out.extend_from_slice(&stage[offset..offset + len])
                }
                Piece::Region { len, .. } => out.extend_from_slice(&data[..len]),
            }
        }
        assert_eq!(out, m.encode_to_vec());
        // A field below `min_ref` is staged; a stage too small says so.
        let mut g = Gather::anywhere(&mut stage, 50_000);
        assert!(EncodeMsg::encode_gather(&m, &mut g).is_none());
    }

    #[test]
    fn gather_copies_small_or_foreign_fields() {
        let region = vec![1u8; 10_000];
        let foreign: bytes::Bytes = vec![2u8; 50_000].into();
        for (data, min_ref) in [
            (foreign.clone(), 4096),
            (bytes::Bytes::from(region[..100].to_vec()), 4096),
        ] {
            let m = Blob {
                seq: 1,
                data,
                note: String::new(),
            };
            let mut stage = vec![0u8; Message::encoded_len(&m)];
            let mut g = Gather::new(&mut stage, &region, min_ref);
            EncodeMsg::encode_gather(&m, &mut g).unwrap();
            assert_eq!(g.referenced(), 0);
            assert_eq!(g.pieces().len(), 1);
            let pieces = g.pieces().to_vec();
            let out = assemble(&pieces, &stage, &region);
            assert_eq!(out, m.encode_to_vec());
        }
        // A staging area too small is refused, and says how much would do.
        let m = Blob {
            seq: 1,
            data: foreign,
            note: String::new(),
        };
        let mut stage = vec![0u8; 10];
        let mut g = Gather::new(&mut stage, &region, 4096);
        assert!(EncodeMsg::encode_gather(&m, &mut g).is_none());
        assert!(g.overflowed());
        assert_eq!(g.needed(), Message::encoded_len(&m));
    }

    #[test]
    fn gather_stages_only_the_unreferenced_part() {
        let region: bytes::Bytes = vec![3u8; 200_000].into();
        let m = Blob {
            seq: 9,
            data: region.slice(..150_000),
            note: "x".repeat(100),
        };
        let staged = Message::encoded_len(&m) - 150_000;
        // Too small: counts what it needs.
        let mut small = vec![0u8; 8];
        let mut g = Gather::new(&mut small, &region, 4096);
        assert!(EncodeMsg::encode_gather(&m, &mut g).is_none());
        assert_eq!(g.needed(), staged);
        // Exactly that: fits.
        let mut stage = vec![0u8; staged];
        let mut g = Gather::new(&mut stage, &region, 4096);
        EncodeMsg::encode_gather(&m, &mut g).unwrap();
        assert_eq!((g.referenced(), g.needed()), (150_000, staged));
        let pieces = g.pieces().to_vec();
        assert_eq!(assemble(&pieces, &stage, &region), m.encode_to_vec());
    }

    #[test]
    fn encodes_exactly_or_refuses() {
        let m = M { s: "hello".into() };
        let mut buf = [0u8; 16];
        let n = EncodeMsg::encode_into(&m, &mut buf).unwrap();
        assert_eq!(&buf[..n], m.encode_to_vec().as_slice());
        let mut small = [0u8; 3];
        assert!(EncodeMsg::encode_into(&m, &mut small).is_none());
    }
}
