/**
 * Reads the rich error details atmost attaches to every failure: the
 * `grpc-status-details-bin` trailer holds a `google.rpc.Status` whose
 * `details` carry ErrorInfo (always, domain "atmost"), RetryInfo (for
 * IDEMPOTENCY_IN_PROGRESS and OVERLOADED) and BadRequest (INVALID_REQUEST).
 */
import type { Metadata } from "@grpc/grpc-js";

import { rpcTypes } from "./proto.js";

/** The `ErrorInfo.domain` of every atmost error. */
export const DOMAIN = "atmost";

const TYPE_PREFIX = "type.googleapis.com/";

/** One field a malformed request broke (google.rpc.BadRequest). */
export interface FieldViolation {
  field: string;
  description: string;
}

/** What the status details said, each part absent when not sent. */
export interface StatusDetails {
  errorInfo?: { reason: string; domain: string; metadata: Record<string, string> };
  retryAfterMs?: number;
  fieldViolations: FieldViolation[];
}

const TO_OBJECT = { longs: Number, enums: String, defaults: true, arrays: true, objects: true };

// The decoded messages (field names as in the .proto: proto.ts loads them
// with keepCase).
interface Any {
  type_url: string;
  value: Uint8Array;
}
interface ErrorInfo {
  reason: string;
  domain: string;
  metadata: Record<string, string>;
}
interface RetryInfo {
  retry_delay?: { seconds: number; nanos: number } | null;
}
interface BadRequest {
  field_violations: { field: string; description: string }[];
}

/**
 * Decodes the details of a failed call from its trailers. A trailer that
 * does not decode (a proxy's, a corrupted one) gives no details rather
 * than an exception: the gRPC code and message still stand.
 */
export function readDetails(trailers: Metadata | undefined): StatusDetails {
  const out: StatusDetails = { fieldViolations: [] };
  const raw = trailers?.get("grpc-status-details-bin")[0];
  if (!(raw instanceof Uint8Array)) return out;
  let details: Any[];
  try {
    const status = rpcTypes.Status.toObject(rpcTypes.Status.decode(raw), TO_OBJECT);
    details = status.details as Any[];
  } catch {
    return out;
  }
  for (const any of details) {
    if (!any.type_url.startsWith(TYPE_PREFIX)) continue;
    try {
      switch (any.type_url.slice(TYPE_PREFIX.length)) {
        case "google.rpc.ErrorInfo": {
          const info = rpcTypes.ErrorInfo.toObject(
            rpcTypes.ErrorInfo.decode(any.value),
            TO_OBJECT,
          ) as ErrorInfo;
          out.errorInfo = { reason: info.reason, domain: info.domain, metadata: { ...info.metadata } };
          break;
        }
        case "google.rpc.RetryInfo": {
          const retry = rpcTypes.RetryInfo.toObject(
            rpcTypes.RetryInfo.decode(any.value),
            TO_OBJECT,
          ) as RetryInfo;
          if (retry.retry_delay) {
            out.retryAfterMs = retry.retry_delay.seconds * 1000 + Math.ceil(retry.retry_delay.nanos / 1e6);
          }
          break;
        }
        case "google.rpc.BadRequest": {
          const bad = rpcTypes.BadRequest.toObject(
            rpcTypes.BadRequest.decode(any.value),
            TO_OBJECT,
          ) as BadRequest;
          out.fieldViolations = bad.field_violations.map((v) => ({
            field: v.field,
            description: v.description,
          }));
          break;
        }
      }
    } catch {
      // One detail that does not decode leaves the others readable.
    }
  }
  return out;
}
