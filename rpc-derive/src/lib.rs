//! `#[service]` on a Rust trait (issue 4).
