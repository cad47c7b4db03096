//! Drives a client and a server `Conn` with arbitrary commands and frames: no panic, no broken
//! invariant.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rpc_core::wire::fuzz::conn_events(data);
});
