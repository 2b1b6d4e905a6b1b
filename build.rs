//! Compiles `proto/atmost/v1/*.proto` with protox (pure Rust, no system
//! `protoc`), generates the tonic services, and writes the file descriptor
//! set that server reflection serves.

use protox::prost::Message;
use std::{env, fs, path::PathBuf};

const PROTOS: &[&str] = &[
    "proto/atmost/v1/types.proto",
    "proto/atmost/v1/gate.proto",
    "proto/atmost/v1/permits.proto",
    "proto/atmost/v1/receipts.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(PROTOS, ["proto"])?;
    let out = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR not set")?);
    fs::write(out.join("atmost_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    Ok(())
}
