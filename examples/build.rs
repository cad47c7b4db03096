//! Generates the examples' messages, clients and servers from `proto/` (protox: no `protoc`).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = concat!(env!("CARGO_MANIFEST_DIR"), "/../proto");
    rpc_codegen::configure()
        // Large values and payloads as `Bytes`: decoded without a copy.
        .bytes([".kv", ".bulk"])
        .compile(
            &[
                format!("{proto}/greeter.proto"),
                format!("{proto}/kv.proto"),
                format!("{proto}/bulk.proto"),
                format!("{proto}/mesh.proto"),
            ],
            &[proto],
        )?;
    Ok(())
}
