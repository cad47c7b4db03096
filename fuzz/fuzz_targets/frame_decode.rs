//! Decodes arbitrary bytes as a frame; whatever decodes must re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rpc_core::wire::fuzz::frame_decode(data);
});
