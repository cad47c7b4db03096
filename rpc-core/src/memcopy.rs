//! Copying payload bytes around a cliff of the C library's `memcpy`.
//!
//! glibc's `memcpy` copies with `rep movsb` from about 2 KiB up to a threshold derived from the
//! cache sizes (about 1 MiB on the development VM's AMD EPYC host). On that host `rep movsb`
//! runs at a twentieth of its speed when the destination lies 1 to 15 bytes past the source,
//! modulo 64: 64 KiB in 27 µs (2.4 GB/s) instead of 1.2 µs (54 GB/s), from 2,049 bytes up to
//! about 1 MB (glibc knows the same cliff on some Intel cores and avoids it there:
//! `Avoid_Short_Distance_REP_MOVSB`).
//!
//! Payload copies here meet that distance all the time: a protobuf `bytes` field's tag and
//! length put the payload a few bytes past where it lies in the source, and the soft RNIC
//! copies between buffers whose offsets follow the frames. The 64 KiB echo with
//! `alloc_bytes` and a response size hint took 23.6 µs p50 there against 13.4 µs without them
//! (the server's RDMA READ of the request: 4 bytes of distance).
//!
//! [`copy`], [`copy_raw`] and [`to_vec`] take such copies (2 KiB to 1 MiB, 1 to 15 bytes of
//! distance) 64 bytes at a time with unaligned vector loads and stores (40 to 58 GB/s at every
//! distance on that host); every other copy goes to `memcpy`.

/// Copies shorter than this go to `memcpy` whatever the distance (it does not use `rep movsb`
/// for them).
const BLOCKWISE_FROM: usize = 2048;

/// Nor copies this long or longer: glibc stops using `rep movsb` on AMD at the L2 cache's size
/// (1 MiB on the largest, Zen 4), and its loops past it are fast at every distance (48 GB/s
/// at 1 MiB on the VM's host, where the blocks manage 40).
const BLOCKWISE_BELOW: usize = 1 << 20;

/// Copies `src` into `dst` (of the same length, like `copy_from_slice`).
///
/// # Panics
/// If the lengths differ.
#[inline]
pub(crate) fn copy(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy between slices of different lengths"
    );
    // SAFETY: two slices of `len` bytes; `&mut` and `&` cannot overlap.
    unsafe { copy_raw(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
}

/// A new vector holding a copy of `src` (as `src.to_vec()`).
pub(crate) fn to_vec(src: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(src.len());
    // SAFETY: `v` has room for `src.len()` bytes, a fresh allocation apart from `src`; they
    // are all written before the length is set.
    unsafe {
        copy_raw(src.as_ptr(), v.as_mut_ptr(), src.len());
        v.set_len(src.len());
    }
    v
}

/// Copies `len` bytes from `src` to `dst` (as `ptr::copy_nonoverlapping`).
///
/// # Safety
/// As for [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable for `len`
/// bytes, the two not overlapping.
#[inline]
pub(crate) unsafe fn copy_raw(src: *const u8, dst: *mut u8, len: usize) {
    if (BLOCKWISE_FROM..BLOCKWISE_BELOW).contains(&len) && short_distance(src, dst) {
        // SAFETY: the caller's contract.
        unsafe { blockwise(src, dst, len) }
    } else {
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
    }
}

/// Whether the destination lies 1 to 15 bytes past the source, modulo 64 (the cliff).
#[inline]
fn short_distance(src: *const u8, dst: *mut u8) -> bool {
    let d = (dst as usize).wrapping_sub(src as usize) & 63;
    d != 0 && d < 16
}

/// 64 bytes at a time (four 16-byte unaligned loads, then four stores), then the tail.
///
/// # Safety
/// As for [`copy_raw`].
#[cfg(target_arch = "x86_64")]
#[inline(never)]
unsafe fn blockwise(src: *const u8, dst: *mut u8, len: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_storeu_si128};
    let mut i = 0usize;
    while i + 64 <= len {
        // SAFETY: `i + 64 <= len`: inside both ranges; unaligned loads and stores.
        unsafe {
            let s = src.add(i).cast::<__m128i>();
            let d = dst.add(i).cast::<__m128i>();
            let a = _mm_loadu_si128(s);
            let b = _mm_loadu_si128(s.add(1));
            let c = _mm_loadu_si128(s.add(2));
            let e = _mm_loadu_si128(s.add(3));
            _mm_storeu_si128(d, a);
            _mm_storeu_si128(d.add(1), b);
            _mm_storeu_si128(d.add(2), c);
            _mm_storeu_si128(d.add(3), e);
        }
        i += 64;
    }
    // SAFETY: the last `len - i < 64` bytes of both ranges (`memcpy` copies them with
    // vector moves, not `rep movsb`).
    unsafe { std::ptr::copy_nonoverlapping(src.add(i), dst.add(i), len - i) }
}

#[cfg(not(target_arch = "x86_64"))]
#[inline]
unsafe fn blockwise(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, len) }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every distance, both paths, lengths around the block size and the threshold: the bytes
    /// arrive exactly, and nothing past the destination is touched.
    #[test]
    fn copies_exactly_at_every_distance() {
        let src: Vec<u8> = (0..20_000u32).map(|i| (i * 7 + 3) as u8).collect();
        for len in [0usize, 1, 63, 64, 65, 2047, 2048, 2049, 4096 + 17, 9000] {
            for s_off in [0usize, 1, 7, 31, 60] {
                for d_off in 0..80usize {
                    let mut dst = vec![0xAAu8; len + 200];
                    copy(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
                    assert_eq!(
                        &dst[d_off..d_off + len],
                        &src[s_off..s_off + len],
                        "len {len}, src +{s_off}, dst +{d_off}"
                    );
                    assert!(dst[..d_off].iter().all(|&b| b == 0xAA), "bytes before");
                    assert!(dst[d_off + len..].iter().all(|&b| b == 0xAA), "bytes after");
                }
            }
        }
    }

    #[test]
    fn to_vec_copies_exactly() {
        let src: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        for off in [0usize, 3, 17] {
            assert_eq!(to_vec(&src[off..]), src[off..].to_vec());
        }
        assert!(to_vec(&[]).is_empty());
    }

    /// Past the block range (`memcpy` again), at a short distance and not.
    #[test]
    fn copies_long_ones_exactly() {
        let len = BLOCKWISE_BELOW + 5;
        let src: Vec<u8> = (0..len as u32 + 64).map(|i| (i * 13 + 1) as u8).collect();
        for (s_off, d_off) in [(0usize, 4usize), (3, 3), (60, 0)] {
            let mut dst = vec![0u8; len + 64];
            copy(&mut dst[d_off..d_off + len], &src[s_off..s_off + len]);
            assert!(
                dst[d_off..d_off + len] == src[s_off..s_off + len],
                "+{s_off} -> +{d_off}"
            );
        }
    }

    #[test]
    fn the_cliff_is_1_to_15_bytes_ahead() {
        let base = 4096usize as *const u8;
        let at = |d: usize| short_distance(base, (4096 + d) as *mut u8);
        assert!(!at(0) && !at(64) && !at(16) && !at(63));
        assert!(at(1) && at(4) && at(15) && at(64 + 4));
        // The destination before the source: 64 - 4 = 60 ahead, modulo 64.
        assert!(!short_distance(base, 4092usize as *mut u8));
    }

    #[test]
    #[should_panic(expected = "different lengths")]
    fn lengths_must_match() {
        copy(&mut [0u8; 3], &[0u8; 4]);
    }
}
