//! Compiles `proto/atmost/v1/*.proto` with protox (pure Rust, no system
//! `protoc`), generates the tonic services, and writes the file descriptor
//! set that server reflection serves. Also writes the descriptor set of
//! Envoy's ext_authz and ext_proc services from `proto/vendor/` (for
//! reflection only: their code comes from the `envoy-types` crate), and the
//! HTTP/JSON edge's: the contract with `google.rpc.Status` and its details,
//! whose JSON its errors are.

use std::{env, fs, path::PathBuf};

const PROTOS: &[&str] = &[
    "proto/atmost/v1/types.proto",
    "proto/atmost/v1/gate.proto",
    "proto/atmost/v1/permits.proto",
    "proto/atmost/v1/receipts.proto",
    "proto/atmost/v1/approvals.proto",
];

/// What the HTTP/JSON edge writes its errors as, beside the contract.
const RPC_STATUS_PROTOS: &[&str] = &["google/rpc/status.proto", "google/rpc/error_details.proto"];

/// The Envoy services atmost serves (src/api/envoy/); their imports are
/// found under proto/vendor/ (google/rpc/status.proto under proto/).
const ENVOY_PROTOS: &[&str] = &[
    "envoy/service/auth/v3/external_auth.proto",
    "envoy/service/ext_proc/v3/external_processor.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let out = PathBuf::from(env::var_os("OUT_DIR").ok_or("OUT_DIR not set")?);
    let atmost = compile(PROTOS.iter(), &["proto"])?;
    fs::write(
        out.join("atmost_descriptor.bin"),
        atmost.encode_file_descriptor_set(),
    )?;
    tonic_prost_build::configure().compile_fds(atmost.file_descriptor_set())?;
    let http = compile(PROTOS.iter().chain(RPC_STATUS_PROTOS), &["proto"])?;
    fs::write(
        out.join("http_descriptor.bin"),
        http.encode_file_descriptor_set(),
    )?;
    let envoy = compile(ENVOY_PROTOS.iter(), &["proto/vendor", "proto"])?;
    fs::write(
        out.join("envoy_descriptor.bin"),
        envoy.encode_file_descriptor_set(),
    )?;
    Ok(())
}

/// `files` and their imports, with their comments. The sets written are
/// encoded by protox itself, which keeps the options' extensions (the
/// `google.api.http` of each RPC) that prost's types would drop.
fn compile<'a>(
    files: impl IntoIterator<Item = &'a &'a str>,
    includes: &[&str],
) -> Result<protox::Compiler, protox::Error> {
    let mut compiler = protox::Compiler::new(includes)?;
    compiler
        .include_source_info(true)
        .include_imports(true)
        .open_files(files.into_iter().copied())?;
    Ok(compiler)
}
