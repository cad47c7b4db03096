//! Compiles every `.proto` under `proto/` (recursively), with tonic's code and adapters.

use std::path::{Path, PathBuf};

fn protos(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            protos(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let mut files = Vec::new();
    protos(&root, &mut files)?;
    files.sort();
    println!("cargo:rerun-if-changed={}", root.display());
    rpc_codegen::configure()
        .emit_tonic(true)
        .bytes([".bench", ".kv"])
        .type_attribute(".test.common.Point", "#[derive(PartialOrd, Ord)]")
        .include_file("protos.rs")
        .compile(&files, &[root])?;
    Ok(())
}
