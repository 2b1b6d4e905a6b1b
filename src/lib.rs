#![forbid(unsafe_code)]
// The handlers' futures nest the store's inside the telemetry's spans
// (instrumented futures): computing their layout goes deeper than the
// default 128 (a compile-time limit, no runtime cost).
#![recursion_limit = "256"]
//! # atmost
//!
//! A permit and receipt boundary in front of side-effecting tool calls made
//! by AI agents. Callers ask [`Gate`](pb::gate_server::Gate) `Authorize`
//! before every side-effecting call and report the outcome with `Commit` or
//! `MarkUncertain`. atmost never dispatches anything itself; its promise is
//! **at most N dispatches per tool per permit**, never "exactly once".
//!
//! ## Layout
//! The modules below; docs/architecture.md maps the whole workspace, follows
//! one Authorize through them, and lists what adding an RPC or a store
//! touches.
//! - `proto/atmost/v1/`: the wire contract, compiled into [`pb`].
//! - [`api`]: the gRPC edge. The tonic services decode, call the store,
//!   encode, and map errors to gRPC status in one place ([`api::status`]);
//!   [`api::layers`] puts auth, admission and the limits in front of them;
//!   the Envoy front doors ([`api::envoy`]: ext_authz, ext_proc) call the
//!   Gate's methods.
//! - [`http`]: the HTTP/JSON edge: each JSON request becomes its RPC's
//!   request in front of the same layers, its answer JSON.
//! - [`domain`]: the pure model: permits, attempts, the state machine
//!   ([`domain::Ledger`]), the order of checks, the one error enum.
//! - [`store`]: one trait, two backends: [`store::memory`] (embedded,
//!   reference semantics) and [`store::redis`] (one Lua script per
//!   transition).
//! - [`server`]: [`run`], which `main` and the tests both call.
//! - The core, which knows no transport and imports neither edge:
//!   [`auth`] (keys and roles), [`idempotency`] (the `Idempotency-Key`
//!   header), [`admission`] (how much store-bound work is
//!   taken on at once), [`transport`] (the limits on what one connection may
//!   cost), [`receipts`] (signing), [`audit`] (a JSON line per
//!   state-changing call, off the request path), [`telemetry`] (a span per
//!   RPC joined to the caller's trace and per store call, the metric
//!   instruments, OTLP and Prometheus export).

pub mod admission;
pub mod api;
pub mod audit;
pub mod auth;
pub mod config;
pub mod domain;
pub mod http;
pub mod idempotency;
pub mod receipts;
pub mod server;
pub mod store;
pub mod telemetry;
pub mod transport;

pub use server::{App, run};

/// The generated protobuf and gRPC code of `atmost.v1`.
pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("atmost.v1");

    /// The file descriptor set served by gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("atmost_descriptor");
}
