/**
 * Loads the `.proto` files this package ships (proto/, a copy of the repo's
 * proto/atmost/v1 kept in step by `npm run sync-proto`, plus googleapis'
 * google/rpc status and error details) at run time.
 *
 * Two loaders, each for what it is good at: proto-loader turns the atmost
 * services into grpc-js client constructors; protobufjs (the parser under
 * proto-loader) decodes the `grpc-status-details-bin` trailer, a
 * `google.rpc.Status` whose details are `google.protobuf.Any`.
 */
import * as grpc from "@grpc/grpc-js";
import * as protoLoader from "@grpc/proto-loader";
import protobuf from "protobufjs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

import type { ProtoGrpcType as ApprovalsProto } from "./generated/approvals.js";
import type { ProtoGrpcType as GateProto } from "./generated/gate.js";
import type { ProtoGrpcType as PermitsProto } from "./generated/permits.js";
import type { ProtoGrpcType as ReceiptsProto } from "./generated/receipts.js";

/** This package's proto/ directory (from dist/src/ once built). */
export const PROTO_DIR = join(dirname(fileURLToPath(import.meta.url)), "..", "..", "proto");

/**
 * The loader options. `proto-loader-gen-types` is run with the same ones
 * (package.json, "gen-types"), so the generated interfaces describe exactly
 * the objects these options produce. `longs: Number` is exact here: every
 * 64-bit value atmost sends (costs, caps, counts) is at most 2^53-1.
 */
export const LOADER_OPTIONS: protoLoader.Options = {
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
  includeDirs: [PROTO_DIR],
};

const packageDefinition = protoLoader.loadSync(
  ["atmost/v1/gate.proto", "atmost/v1/permits.proto", "atmost/v1/receipts.proto", "atmost/v1/approvals.proto"],
  LOADER_OPTIONS,
);

/** The loaded `atmost.v1` package: service client constructors and enums. */
export const atmostV1 = (grpc.loadPackageDefinition(packageDefinition) as unknown as GateProto &
  PermitsProto &
  ReceiptsProto &
  ApprovalsProto).atmost.v1;

const rpcRoot = new protobuf.Root();
// Every import resolves inside PROTO_DIR; google/protobuf/*.proto (Any,
// Duration) come bundled with protobufjs, which it picks by that path.
rpcRoot.resolvePath = (_origin: string, target: string) => join(PROTO_DIR, target);
// keepCase: field names as in the .proto (`type_url`, `retry_delay`), the
// same as the bundled google/protobuf types, which are never camel-cased.
rpcRoot.loadSync(["google/rpc/status.proto", "google/rpc/error_details.proto"], { keepCase: true });

/** The protobufjs types of google.rpc, for the status details. */
export const rpcTypes = {
  Status: rpcRoot.lookupType("google.rpc.Status"),
  ErrorInfo: rpcRoot.lookupType("google.rpc.ErrorInfo"),
  RetryInfo: rpcRoot.lookupType("google.rpc.RetryInfo"),
  BadRequest: rpcRoot.lookupType("google.rpc.BadRequest"),
};
