//! Every `.proto` of `proto/`, compiled by `build.rs` through rpc-codegen with tonic's code and
//! adapters; the tests under `tests/` check the generated code.
#![allow(missing_docs)]

include!(concat!(env!("OUT_DIR"), "/protos.rs"));

/// The encoded `FileDescriptorSet` of every file compiled above (and their imports), as
/// `Builder::file_descriptor_set_path` wrote it: what a server registers for reflection
/// (`ServerBuilder::register_file_descriptor_set`).
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/descriptors.bin"));

/// `proto/test/rdma_only/`: services tonic-build's own code cannot compile, generated without
/// `emit_tonic` (their messages are those of [`test::collide`]).
pub mod rdma_only {
    include!(concat!(env!("OUT_DIR"), "/rdma_only/test.collide.bare.rs"));
}
