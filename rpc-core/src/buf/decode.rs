//! Decoding prost messages straight out of registered memory.
//!
//! [`SlotReader`] is a [`bytes::Buf`] over a byte range of an owned buffer (a receive slot or a
//! bulk buffer). Scalar and string fields are decoded from the registered bytes in place. A
//! `bytes::Bytes` field of at least [`ZERO_COPY_MIN`] bytes borrows the buffer instead of being
//! copied, when the owner may be lent ([`Lend`]: a receive slot asks its connection's lending
//! budget): the first such field turns the owner into one `Bytes` (`Bytes::from_owner`, one
//! small allocation per message) and every such field is a slice of it. The buffer then goes
//! back to its ring or pool when the last slice is dropped. An owner that may not be lent (a
//! receive slot past the budget) has its large fields copied, so the slot goes back to the ring
//! when decoding ends, however long the user keeps the message. Messages without such fields
//! allocate nothing here.

use bytes::{Buf, Bytes};

use super::RecvSlot;

/// Smallest `bytes` field that borrows the receive buffer instead of being copied.
pub const ZERO_COPY_MIN: usize = 512;

/// A buffer that decoded `bytes` fields may borrow.
pub trait Lend: AsRef<[u8]> + Send + 'static {
    /// Whether the buffer may be kept by the decoded message's `Bytes` for as long as the user
    /// keeps them (asked once, before the first field borrows it). Buffers of a pool that grows
    /// on demand may (the default); a receive slot answers from its connection's lending budget.
    fn try_lend(&mut self) -> bool {
        true
    }
}

impl Lend for RecvSlot {
    fn try_lend(&mut self) -> bool {
        RecvSlot::try_lend(self)
    }
}

impl Lend for Vec<u8> {}

impl<P: crate::verbs::Provider> Lend for super::BulkBuf<P> {}

/// A [`Buf`] over `owner.as_ref()[start..end]`.
#[derive(Debug)]
pub struct SlotReader<O: Lend> {
    owner: Option<O>,
    shared: Option<Bytes>,
    pos: usize,
    end: usize,
    /// The owner may not be lent: large fields are copied.
    copy: bool,
}

impl<O: Lend> SlotReader<O> {
    /// A reader of `owner.as_ref()[start..end]` (clamped to the owner's length).
    pub fn new(owner: O, start: usize, end: usize) -> SlotReader<O> {
        let len = owner.as_ref().len();
        let end = end.min(len);
        let pos = start.min(end);
        SlotReader {
            owner: Some(owner),
            shared: None,
            pos,
            end,
            copy: false,
        }
    }

    fn all(&self) -> &[u8] {
        match (&self.shared, &self.owner) {
            (Some(b), _) => b,
            (None, Some(o)) => o.as_ref(),
            (None, None) => &[],
        }
    }

    /// Whether the owner was turned into shared `Bytes` (some field borrows it).
    #[cfg(test)]
    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }
}

impl<O: Lend> Buf for SlotReader<O> {
    fn remaining(&self) -> usize {
        self.end - self.pos
    }

    fn chunk(&self) -> &[u8] {
        &self.all()[self.pos..self.end]
    }

    fn advance(&mut self, cnt: usize) {
        assert!(cnt <= self.remaining(), "advance past the end of the frame");
        self.pos += cnt;
    }

    fn copy_to_bytes(&mut self, len: usize) -> Bytes {
        assert!(
            len <= self.remaining(),
            "copy_to_bytes past the end of the frame"
        );
        if self.shared.is_none()
            && !self.copy
            && len >= ZERO_COPY_MIN
            && let Some(o) = self.owner.as_mut()
        {
            if o.try_lend() {
                if let Some(o) = self.owner.take() {
                    self.shared = Some(Bytes::from_owner(o));
                }
            } else {
                self.copy = true;
            }
        }
        let b = match &self.shared {
            Some(s) if len >= ZERO_COPY_MIN => s.slice(self.pos..self.pos + len),
            _ => copied(&self.chunk()[..len]),
        };
        self.pos += len;
        b
    }
}

/// Fields up to this long are copied into the one allocation of their `Bytes` (see
/// [`copied`]).
const INLINE_MAX: usize = 256;

/// A copy of a field that does not borrow the buffer. prost's encoder clones every `Bytes`
/// field it writes (`buf.put(field.clone())`), and a `Bytes` made from a `Vec` allocates a
/// shared header at its first clone: a handler that sends on a field it received (an echo, a
/// proxy) paid two allocations per field. Up to [`INLINE_MAX`] bytes are held inline in the one
/// allocation of `Bytes::from_owner`, whose clones only count references.
fn copied(src: &[u8]) -> Bytes {
    match src.len() {
        0 => Bytes::new(),
        n if n <= 64 => Inline::<64>::bytes(src),
        n if n <= INLINE_MAX => Inline::<INLINE_MAX>::bytes(src),
        _ => Bytes::from(crate::memcopy::to_vec(src)),
    }
}

/// A short field's bytes, inline (see [`copied`]).
struct Inline<const N: usize> {
    len: usize,
    buf: [u8; N],
}

impl<const N: usize> Inline<N> {
    fn bytes(src: &[u8]) -> Bytes {
        let mut b = Inline {
            len: src.len(),
            buf: [0; N],
        };
        b.buf[..src.len()].copy_from_slice(src);
        Bytes::from_owner(b)
    }
}

impl<const N: usize> AsRef<[u8]> for Inline<N> {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    #[derive(Clone, PartialEq, prost::Message)]
    struct Blob {
        #[prost(uint64, tag = "1")]
        id: u64,
        #[prost(bytes = "bytes", tag = "2")]
        data: Bytes,
    }

    #[test]
    fn large_bytes_fields_borrow_the_buffer() {
        let msg = Blob {
            id: 7,
            data: Bytes::from(vec![9u8; 4096]),
        };
        let mut enc = vec![0xAAu8; 3];
        msg.encode(&mut enc).unwrap();
        let ptr_range = enc.as_ptr_range();
        let mut r = SlotReader::new(enc, 3, usize::MAX);
        let back = Blob::decode(&mut r).unwrap();
        assert_eq!(back, msg);
        assert!(r.is_shared());
        let p = back.data.as_ptr();
        assert!(
            ptr_range.contains(&p),
            "the field must point into the receive buffer"
        );
    }

    #[test]
    fn small_messages_do_not_share() {
        let msg = Blob {
            id: 1,
            data: Bytes::from_static(b"hi"),
        };
        let enc = msg.encode_to_vec();
        let n = enc.len();
        let mut r = SlotReader::new(enc, 0, n);
        assert_eq!(Blob::decode(&mut r).unwrap(), msg);
        assert!(!r.is_shared());
    }

    /// An owner that may not be lent, as a receive slot past its connection's budget.
    struct NoLend(Vec<u8>);

    impl AsRef<[u8]> for NoLend {
        fn as_ref(&self) -> &[u8] {
            &self.0
        }
    }

    impl Lend for NoLend {
        fn try_lend(&mut self) -> bool {
            false
        }
    }

    #[test]
    fn an_owner_past_its_budget_has_large_fields_copied() {
        let msg = Blob {
            id: 7,
            data: Bytes::from(vec![5u8; 4096]),
        };
        let enc = msg.encode_to_vec();
        let n = enc.len();
        let range = enc.as_ptr_range();
        let mut r = SlotReader::new(NoLend(enc), 0, n);
        let back = Blob::decode(&mut r).unwrap();
        assert_eq!(back, msg);
        assert!(!r.is_shared());
        assert!(
            !range.contains(&back.data.as_ptr()),
            "the field must be a copy"
        );
    }

    #[test]
    fn short_fields_are_exact_copies_whatever_their_size_class() {
        for n in [0usize, 1, 63, 64, 65, 255, 256, 257, ZERO_COPY_MIN - 1] {
            let msg = Blob {
                id: n as u64,
                data: Bytes::from((0..n).map(|i| (i * 7 + 3) as u8).collect::<Vec<u8>>()),
            };
            let enc = msg.encode_to_vec();
            let len = enc.len();
            let range = enc.as_ptr_range();
            let mut r = SlotReader::new(enc, 0, len);
            let back = Blob::decode(&mut r).unwrap();
            assert_eq!(back, msg, "{n} bytes");
            assert_eq!(back.data.len(), n);
            assert!(!r.is_shared());
            assert!(n == 0 || !range.contains(&back.data.as_ptr()), "a copy");
            // A clone (what prost's encoder makes of every field it writes) is the same bytes.
            let again = back.data.clone();
            assert_eq!(again, back.data);
            assert_eq!(Blob::decode(msg.encode_to_vec().as_slice()).unwrap(), back);
        }
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut r = SlotReader::new(vec![0x12u8, 0xff, 0xff, 0xff, 0xff, 0x0f, 1, 2], 0, 8);
        assert!(Blob::decode(&mut r).is_err());
    }
}
