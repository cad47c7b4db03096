//! Generates `bench.proto`'s messages, the rdma-rpc client and server, and tonic's gRPC client
//! and server (with the adapter serving one implementation over both), through rpc-codegen.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto");
    rpc_codegen::configure()
        .emit_tonic(true)
        // Payloads as `Bytes`: rdma-rpc decodes them without a copy, tonic shares its buffer.
        .bytes([".bench"])
        .compile(&[format!("{proto}/bench.proto")], &[proto])?;
    Ok(())
}
