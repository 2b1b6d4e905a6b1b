//! Compiles `proto/atmost/v1/*.proto` with protox (pure Rust, no system
//! `protoc`), generates the tonic services, and writes the file descriptor
//! set that server reflection serves. Also writes the descriptor set of
//! Envoy's ext_authz and ext_proc services from `proto/vendor/` (for
//! reflection only: their code comes from the `envoy-types` crate).

use protox::prost::Message;
use std::{env, fs, path::PathBuf};

const PROTOS: &[&str] = &[
    "proto/atmost/v1/types.proto",
    "proto/atmost/v1/gate.proto",
    "proto/atmost/v1/permits.proto",
    "proto/atmost/v1/receipts.proto",
];

/// The Envoy services atmost serves (src/api/envoy/); their imports are
/// found under proto/vendor/.
const ENVOY_PROTOS: &[&str] = &[
    "envoy/service/auth/v3/external_auth.proto",
    "envoy/service/ext_proc/v3/external_processor.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(PROTOS, ["proto"])?;
    let out = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR not set")?);
    fs::write(out.join("atmost_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure().compile_fds(fds)?;
    let envoy = protox::compile(ENVOY_PROTOS, ["proto/vendor"])?;
    fs::write(out.join("envoy_descriptor.bin"), envoy.encode_to_vec())?;
    Ok(())
}
