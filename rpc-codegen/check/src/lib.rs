//! Every `.proto` of `proto/`, compiled by `build.rs` through rpc-codegen with tonic's code and
//! adapters; the tests under `tests/` check the generated code.
#![allow(missing_docs)]

include!(concat!(env!("OUT_DIR"), "/protos.rs"));
