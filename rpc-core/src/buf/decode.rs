//! Decoding prost messages straight out of registered memory.
//!
//! [`SlotReader`] is a [`bytes::Buf`] over a byte range of an owned buffer (a receive slot or a
//! bulk buffer). Scalar and string fields are decoded from the registered bytes in place. A
//! `bytes::Bytes` field of at least [`ZERO_COPY_MIN`] bytes borrows the buffer instead of being
//! copied: the first such field turns the owner into one `Bytes` (`Bytes::from_owner`, one small
//! allocation per message) and every such field is a slice of it. The buffer then goes back to
//! its pool when the last slice is dropped. Messages without such fields allocate nothing here.

use bytes::{Buf, Bytes};

/// Smallest `bytes` field that borrows the receive buffer instead of being copied.
pub const ZERO_COPY_MIN: usize = 512;

/// A [`Buf`] over `owner.as_ref()[start..end]`.
#[derive(Debug)]
pub struct SlotReader<O: AsRef<[u8]> + Send + 'static> {
    owner: Option<O>,
    shared: Option<Bytes>,
    pos: usize,
    end: usize,
}

impl<O: AsRef<[u8]> + Send + 'static> SlotReader<O> {
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
    pub fn is_shared(&self) -> bool {
        self.shared.is_some()
    }
}

impl<O: AsRef<[u8]> + Send + 'static> Buf for SlotReader<O> {
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
        if len < ZERO_COPY_MIN {
            let b = Bytes::copy_from_slice(&self.chunk()[..len]);
            self.pos += len;
            return b;
        }
        if self.shared.is_none()
            && let Some(o) = self.owner.take()
        {
            self.shared = Some(Bytes::from_owner(o));
        }
        let b = match &self.shared {
            Some(s) => s.slice(self.pos..self.pos + len),
            None => Bytes::new(),
        };
        self.pos += len;
        b
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

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut r = SlotReader::new(vec![0x12u8, 0xff, 0xff, 0xff, 0xff, 0x0f, 1, 2], 0, 8);
        assert!(Blob::decode(&mut r).is_err());
    }
}
