//! Compiles every `.proto` under `proto/` (recursively), with tonic's code and adapters, and
//! writes their encoded `FileDescriptorSet` to `$OUT_DIR/descriptors.bin` (for reflection).
//!
//! `proto/test/third_party/` is a second include root, as a vendored googleapis would be: its
//! files are imported as `google/api/annotations.proto`, so they are compiled as imports of the
//! files that use them, not found by the walk (under the first root they would have a second
//! name, `test/third_party/google/api/..`, and define every symbol twice).
//!
//! `proto/test/rdma_only/` holds services whose tonic code does not compile (tonic-build names
//! some items without a path); it is compiled a second time without `emit_tonic`, into
//! `$OUT_DIR/rdma_only/`, with the messages it imports taken from the first pass.

use std::path::{Path, PathBuf};

fn protos(dir: &Path, skip: &[PathBuf], out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if skip.contains(&path) {
            continue;
        }
        if path.is_dir() {
            protos(&path, skip, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let third_party = root.join("test/third_party");
    let rdma_only = root.join("test/rdma_only");
    let mut files = Vec::new();
    protos(&root, &[third_party.clone(), rdma_only.clone()], &mut files)?;
    files.sort();
    println!("cargo:rerun-if-changed={}", root.display());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    rpc_codegen::configure()
        .emit_tonic(true)
        .file_descriptor_set_path(out.join("descriptors.bin"))
        .bytes([".bench", ".kv"])
        .type_attribute(".test.common.Point", "#[derive(PartialOrd, Ord)]")
        .include_file("protos.rs")
        .compile(&files, &[root.clone(), third_party])?;

    let mut files = Vec::new();
    protos(&rdma_only, &[], &mut files)?;
    files.sort();
    rpc_codegen::configure()
        .extern_path(".test.collide", "crate::test::collide")
        .out_dir(out.join("rdma_only"))
        .compile(&files, &[root])?;
    Ok(())
}
