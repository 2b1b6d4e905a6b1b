//! Generates the client stubs of `atmost.v1` from the service's own
//! `proto/` (the one wire contract), with protox: no system `protoc`.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../proto");
    println!("cargo:rerun-if-changed={}", proto.display());
    let files = [
        "types.proto",
        "gate.proto",
        "permits.proto",
        "receipts.proto",
        "approvals.proto",
    ]
    .map(|f| proto.join("atmost/v1").join(f));
    let fds = protox::compile(files, [&proto])?;
    tonic_prost_build::configure()
        .build_server(false)
        .compile_fds(fds)?;
    Ok(())
}
