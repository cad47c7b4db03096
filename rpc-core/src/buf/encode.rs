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
}

impl<M: Message> EncodeMsg for M {
    fn encoded_len(&self) -> usize {
        Message::encoded_len(self)
    }

    fn encode_into(&self, out: &mut [u8]) -> Option<usize> {
        let len = Message::encoded_len(self);
        let mut w = out.get_mut(..len)?;
        self.encode_raw(&mut w);
        debug_assert!(w.is_empty(), "prost encoded_len disagrees with encode_raw");
        Some(len - w.len())
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
        dst.copy_from_slice(self.0);
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
