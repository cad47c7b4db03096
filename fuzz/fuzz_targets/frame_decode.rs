//! Decodes arbitrary bytes as the frames of one SEND (a batch); whatever decodes must
//! re-encode to the same bytes and tile the SEND.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rpc_core::wire::fuzz::frame_decode(data);
});
