//! Decodes arbitrary bytes as a metadata block; whatever decodes must re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rpc_core::wire::fuzz::metadata_decode(data);
});
