//! Packed stream messages ([`FrameFlags::PACKED`]): the payload of one StreamMessage frame
//! holding several consecutive messages of its stream, each a little-endian `u32` length and
//! that many bytes:
//!
//! ```text
//! header (aux = n, seq = s) | metadata | len 0 | message s | len 1 | message s+1 | .. | message s+n-1
//! ```
//!
//! [`check`] is the receiver's rule (run by [`super::decode`], so a packed frame that reaches
//! the protocol tiles its payload exactly); [`next`] walks a checked payload; [`append`] is
//! the sender's: it grows the stream's last frame, still unsent in a send slot, by one
//! message, turning a plain frame into a packed one on the first append.

use super::WireError;
use super::frame::{BASE_HEADER_LEN, FrameFlags, FrameKind, WIRE_VERSION};

/// Bytes of the length before each packed message.
pub const PREFIX_LEN: usize = 4;

/// Offsets of the base header's fields that packing rewrites (see [`super::frame`]).
const FLAGS_AT: usize = 2;
const AUX_AT: usize = 8;
const METADATA_LEN_AT: usize = 14;
const PAYLOAD_LEN_AT: usize = 16;

/// Checks that `payload` is exactly `count` messages, each a `u32` length and that many bytes.
///
/// # Errors
/// [`WireError::Packed`] naming the first message whose length is cut short or runs past the
/// payload, or bytes left after the last message.
pub fn check(payload: &[u8], count: u32) -> Result<(), WireError> {
    let mut at = 0usize;
    for index in 0..count {
        at = match next(payload, at) {
            Some((_, end)) => end,
            None => {
                return Err(WireError::Packed {
                    index,
                    why: if payload.len().saturating_sub(at) < PREFIX_LEN {
                        "its length is cut short by the end of the payload"
                    } else {
                        "its length runs past the end of the payload"
                    },
                });
            }
        };
    }
    if at != payload.len() {
        return Err(WireError::Packed {
            index: count,
            why: "bytes after the last message the header counts",
        });
    }
    Ok(())
}

/// The message whose length starts at offset `at` of a packed payload: the range of its bytes
/// (its end is where the next length starts); `None` when the payload ends before it does.
pub fn next(payload: &[u8], at: usize) -> Option<(usize, usize)> {
    let prefix = payload.get(at..at.checked_add(PREFIX_LEN)?)?;
    let len = u32::from_le_bytes(prefix.try_into().ok()?) as usize;
    let start = at + PREFIX_LEN;
    let end = start.checked_add(len)?;
    (end <= payload.len()).then_some((start, end))
}

/// Bytes a frame grows by when a `len`-byte message is appended: its length and bytes, plus
/// the first message's length when the frame is not packed yet.
pub const fn growth(packed: bool, len: usize) -> usize {
    PREFIX_LEN + len + if packed { 0 } else { PREFIX_LEN }
}

/// Whether the encoded header at the start of `frame` is already [`FrameFlags::PACKED`].
pub fn is_packed(frame: &[u8]) -> bool {
    read_u16(frame, FLAGS_AT).is_some_and(|f| f & FrameFlags::PACKED.bits() != 0)
}

/// Sender: appends a `len`-byte message to the StreamMessage frame encoded at the start of
/// `frame`, which must have a base header only (no extension) and run to the end of its send
/// slot; `encode` writes the message into the slice it is given and returns the bytes written.
/// A plain frame becomes packed (its message moves [`PREFIX_LEN`] bytes on, behind its length).
/// Returns the bytes the frame grew by ([`growth`]). The stream's protocol state (sequence,
/// window) is the caller's: see [`super::Conn::stream_message_packed`].
///
/// # Errors
/// [`WireError::Inconsistent`] when the header is not such a frame, or `encode` wrote another
/// length; [`WireError::BufferTooSmall`] when the slot has no room for the message. Nothing is
/// changed then.
pub fn append(
    frame: &mut [u8],
    len: usize,
    encode: impl FnOnce(&mut [u8]) -> Option<usize>,
) -> Result<usize, WireError> {
    let bad = |why| Err(WireError::Inconsistent(why));
    if frame.len() < BASE_HEADER_LEN
        || frame[0] != WIRE_VERSION
        || frame[1] != FrameKind::StreamMessage as u8
    {
        return bad("packing onto bytes that are not a StreamMessage header");
    }
    let flags = read_u16(frame, FLAGS_AT).unwrap_or(u16::MAX);
    if flags & FrameFlags::EXTENSIONS.bits() != 0 || flags & FrameFlags::MORE.bits() != 0 {
        return bad("packing onto a frame with an extension, or one that is not the last");
    }
    let packed = flags & FrameFlags::PACKED.bits() != 0;
    let aux = read_u32(frame, AUX_AT).unwrap_or(0);
    let md = usize::from(read_u16(frame, METADATA_LEN_AT).unwrap_or(0));
    let pl = read_u32(frame, PAYLOAD_LEN_AT).unwrap_or(0) as usize;
    let body = BASE_HEADER_LEN + md;
    let grown = growth(packed, len);
    let (Some(new_pl), Some(new_aux)) = (
        u32::try_from(pl + grown).ok(),
        if packed { aux.checked_add(1) } else { Some(2) },
    ) else {
        return bad("a packed frame longer than 4 GiB or 2^32 messages");
    };
    let need = body + pl + grown;
    if frame.len() < need {
        return Err(WireError::BufferTooSmall {
            need,
            have: frame.len(),
        });
    }
    // Where the new message's length goes (after the first message's, when that moves).
    let end = body + pl + if packed { 0 } else { PREFIX_LEN };
    let at = end + PREFIX_LEN;
    // Encoded first, past the frame's bytes: a failure leaves the frame as it was.
    if encode(&mut frame[at..at + len]) != Some(len) {
        return bad("a packed message encoded to another length than it said");
    }
    if !packed {
        // The frame's one message moves behind its length.
        frame.copy_within(body..body + pl, body + PREFIX_LEN);
        frame[body..body + PREFIX_LEN].copy_from_slice(&(pl as u32).to_le_bytes());
    }
    frame[end..at].copy_from_slice(&(len as u32).to_le_bytes());
    let flags = flags | FrameFlags::PACKED.bits();
    frame[FLAGS_AT..FLAGS_AT + 2].copy_from_slice(&flags.to_le_bytes());
    frame[AUX_AT..AUX_AT + 4].copy_from_slice(&new_aux.to_le_bytes());
    frame[PAYLOAD_LEN_AT..PAYLOAD_LEN_AT + 4].copy_from_slice(&new_pl.to_le_bytes());
    Ok(grown)
}

fn read_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{FrameHeader, decode};

    /// A plain StreamMessage frame of `payload` at the start of a 256-byte slot.
    fn plain(payload: &[u8], md: &[u8]) -> Vec<u8> {
        let h = FrameHeader {
            seq: 7,
            metadata_len: md.len() as u16,
            payload_len: payload.len() as u32,
            credits: 3,
            ..FrameHeader::new(FrameKind::StreamMessage, 0x10001)
        };
        let mut slot = vec![0u8; 256];
        let n = h.encode(&mut slot).unwrap();
        slot[n..n + md.len()].copy_from_slice(md);
        slot[n + md.len()..n + md.len() + payload.len()].copy_from_slice(payload);
        slot
    }

    fn messages(payload: &[u8], count: u32) -> Vec<Vec<u8>> {
        check(payload, count).unwrap();
        let mut at = 0;
        (0..count)
            .map(|_| {
                let (s, e) = next(payload, at).unwrap();
                at = e;
                payload[s..e].to_vec()
            })
            .collect()
    }

    fn put(m: &[u8]) -> impl FnOnce(&mut [u8]) -> Option<usize> + '_ {
        move |out: &mut [u8]| {
            out.get_mut(..m.len())?.copy_from_slice(m);
            Some(m.len())
        }
    }

    #[test]
    fn appends_turn_a_plain_frame_into_a_packed_one() {
        let mut slot = plain(b"first", b"md");
        assert_eq!(append(&mut slot, 3, put(b"two")).unwrap(), 4 + 4 + 3);
        assert_eq!(append(&mut slot, 0, put(b"")).unwrap(), 4);
        assert_eq!(
            append(&mut slot, 5, put(b"fourth")).unwrap_err(),
            WireError::Inconsistent("a packed message encoded to another length than it said")
        );
        let f = decode(&slot).unwrap();
        assert!(f.header.flags.contains(FrameFlags::PACKED));
        assert_eq!((f.header.aux, f.header.seq, f.header.credits), (3, 7, 3));
        assert_eq!(f.metadata, b"md");
        assert_eq!(
            messages(f.payload, 3),
            vec![b"first".to_vec(), b"two".to_vec(), vec![]]
        );
        // The header still encodes the same (every rule holds).
        let mut out = [0u8; 24];
        f.header.encode(&mut out).unwrap();
        assert_eq!(&out[..], &slot[..24]);
    }

    #[test]
    fn append_refuses_what_it_cannot_pack_and_changes_nothing() {
        let mut slot = plain(b"x", b"");
        slot.truncate(24 + 1 + 8);
        let before = slot.clone();
        assert!(matches!(
            append(&mut slot, 1, put(b"y")),
            Err(WireError::BufferTooSmall { need: 34, have: 33 })
        ));
        assert_eq!(slot, before);
        let mut slot = plain(b"abc", b"");
        let before = slot.clone();
        assert!(append(&mut slot, 2, |_| None).is_err());
        assert_eq!(
            slot[..27],
            before[..27],
            "a failed encode leaves the plain frame"
        );
        let mut status = plain(b"", b"");
        status[1] = FrameKind::Status as u8;
        assert!(append(&mut status, 1, put(b"y")).is_err());
        let mut more = plain(b"a", b"");
        more[2] |= FrameFlags::MORE.bits() as u8;
        assert!(
            append(&mut more, 1, put(b"y")).is_err(),
            "not the last frame"
        );
    }

    #[test]
    fn check_names_what_is_wrong() {
        let mut p = Vec::new();
        for m in [&b"ab"[..], b"", b"xyz"] {
            p.extend_from_slice(&(m.len() as u32).to_le_bytes());
            p.extend_from_slice(m);
        }
        assert_eq!(messages(&p, 3)[2], b"xyz");
        let at = |e: WireError| match e {
            WireError::Packed { index, .. } => index,
            e => panic!("{e:?}"),
        };
        assert_eq!(at(check(&p, 2).unwrap_err()), 2, "bytes after the count");
        assert_eq!(at(check(&p, 4).unwrap_err()), 3, "a message missing");
        assert_eq!(at(check(&p[..p.len() - 1], 3).unwrap_err()), 2, "cut short");
        let mut huge = p.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(at(check(&huge, 3).unwrap_err()), 0);
        assert!(check(&[], 0).is_ok());
        assert!(next(&[1, 0], 0).is_none());
        assert!(next(&p, usize::MAX).is_none());
    }

    proptest::proptest! {
        /// Whatever the messages, appending them gives a frame that decodes to the same
        /// messages in order; the frame cut anywhere short, or with a length grown, is
        /// refused by `decode` (never a panic, never other messages).
        #[test]
        fn appended_messages_round_trip_and_damage_is_refused(
            // Non-zero bytes: a length read one or two bytes off then is never small enough
            // to tile the payload by chance (see the damage below).
            msgs in proptest::collection::vec(proptest::collection::vec(1u8..=255, 0..40), 1..12),
            md in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..8),
            bump in 1u32..3,
            which in 0usize..12,
        ) {
            let mut slot = plain(&msgs[0], &md);
            slot.resize(1024, 0);
            for m in &msgs[1..] {
                append(&mut slot, m.len(), put(m)).unwrap();
            }
            let f = decode(&slot).unwrap();
            let n = msgs.len() as u32;
            let len = f.header.frame_len() as usize;
            if n > 1 {
                proptest::prop_assert_eq!(f.header.aux, n);
                proptest::prop_assert_eq!(messages(f.payload, n), msgs.clone());
                for cut in 0..len {
                    proptest::prop_assert!(decode(&slot[..cut]).is_err());
                }
                // A length that claims more bytes than its message has.
                let mut at = 24 + md.len();
                for m in msgs.iter().take(which % msgs.len()) {
                    at += 4 + m.len();
                }
                let mut bad = slot[..len].to_vec();
                let l = u32::from_le_bytes(bad[at..at + 4].try_into().unwrap());
                bad[at..at + 4].copy_from_slice(&l.wrapping_add(bump).to_le_bytes());
                proptest::prop_assert!(decode(&bad).is_err());
            } else {
                proptest::prop_assert!(!f.header.flags.contains(FrameFlags::PACKED));
                proptest::prop_assert_eq!(f.payload, &msgs[0][..]);
            }
        }
    }

    #[test]
    fn decode_checks_packed_payloads() {
        let mut slot = plain(b"first", b"");
        append(&mut slot, 3, put(b"two")).unwrap();
        let len = decode(&slot).unwrap().header.frame_len() as usize;
        // The second length claims one byte more: runs past the payload.
        slot[24 + 4 + 5] = 4;
        assert!(matches!(
            decode(&slot[..len]),
            Err(WireError::Packed { index: 1, .. })
        ));
        slot[24 + 4 + 5] = 3;
        // A count of 3 with two messages.
        slot[8] = 3;
        assert!(matches!(
            decode(&slot[..len]),
            Err(WireError::Packed { index: 2, .. })
        ));
        slot[8] = 0;
        assert!(matches!(
            decode(&slot[..len]),
            Err(WireError::Inconsistent(_))
        ));
    }
}
