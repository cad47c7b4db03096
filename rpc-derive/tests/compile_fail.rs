//! `#[service]`'s error messages, pinned by trybuild (`.stderr` files next to the cases).
//! After an intended change: `TRYBUILD=overwrite cargo test -p rpc-derive --test compile_fail`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
