//! The hostile-input campaign: one table of requests a buggy or hostile
//! client may send, each over a raw HTTP/2 gRPC call on loopback to the
//! real server, on each store. Every row asserts
//! - the exact answer: atmost's status code and ErrorInfo reason (for
//!   INVALID_REQUEST, also a field its BadRequest names), or that the
//!   transport or the codec refused the bytes before atmost (a code and no
//!   ErrorInfo), or that the request was accepted;
//! - that an error stays small on the wire: `grpc-message` plus
//!   `grpc-status-details-bin` under [`ERROR_BUDGET`], with at most 16
//!   field violations and a count;
//! - that the store reads back exactly as before ([`Snapshot`]): the
//!   permits the campaign set up, with their usage and budget, the
//!   uncertain listings and their page tokens, the attempts of known keys,
//!   and on Redis every key under the test's prefix, so a refused
//!   CreatePermit left nothing behind either. (No RPC lists permits, so on
//!   the memory store a permit nobody was told of cannot be seen; CreatePermit
//!   validates the whole permit before either store is asked.)
//!
//! The few accepted rows are reads, repeats of an outcome already recorded
//! (which change nothing), or CreatePermits whose only change is the new
//! permit, read back exactly as sent. Control characters are refused in
//! ids, tools, keys, agents and page tokens; free text (subject, currency,
//! failure and uncertain reasons) keeps them, stored and answered byte for
//! byte (the one logged, the subject, is logged escaped).
//!
//! Every row runs; the rows that fail are listed together at the end.

use crate::support::*;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};
use tonic::Code;

/// The most an error may take on the wire: `grpc-message` plus
/// `grpc-status-details-bin`, as sent.
const ERROR_BUDGET: usize = 8 * 1024;

/// The server's largest request message (`--max-request-bytes`' default):
/// a request larger than this is refused by the transport
/// (RESOURCE_EXHAUSTED / MESSAGE_TOO_LARGE) before atmost reads it,
/// whatever its row expects of atmost.
const MAX_DECODE_BYTES: usize = atmost::transport::Limits::DEFAULT.max_request_bytes;

/// The largest amount atmost accepts: 2^53 - 1.
const MAX_AMOUNT: i64 = (1 << 53) - 1;

const AUTHORIZE: &str = "/atmost.v1.Gate/Authorize";
const COMMIT: &str = "/atmost.v1.Gate/Commit";
const MARK_UNCERTAIN: &str = "/atmost.v1.Gate/MarkUncertain";
const CREATE: &str = "/atmost.v1.Permits/CreatePermit";
const GET: &str = "/atmost.v1.Permits/GetPermit";
const GET_ATTEMPT: &str = "/atmost.v1.Permits/GetAttempt";
const REVOKE: &str = "/atmost.v1.Permits/RevokePermit";
const LIST: &str = "/atmost.v1.Permits/ListUncertain";
const RESOLVE: &str = "/atmost.v1.Permits/Resolve";
const HEALTH: &str = "/grpc.health.v1.Health/Check";

/// NUL, a terminal escape, CR LF, a tab, DEL and a right-to-left override:
/// valid UTF-8 that no log line or terminal should take as it is (12
/// bytes, so it fits even the currency).
const CTRL: &str = "\u{0}\u{1b}[2J\r\n\t\u{7f}\u{202e}";

/// Oversized for every field, yet far below any sane transport limit.
const BIG: usize = 100 * 1024;
/// Oversized for every field, for rows that oversize them all at once.
const MID: usize = 16 * 1024;

fn big(n: usize) -> String {
    "a".repeat(n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_memory() {
    let _machine = shared().await;
    campaign(Harness::start(Kind::Memory).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_redis() {
    let _machine = shared().await;
    campaign(Harness::start(Kind::Redis).await).await;
}

async fn campaign(h: Harness) {
    let f = set_up(&h).await;
    let mut before = snapshot(&h, &f).await;
    assert_eq!(
        snapshot(&h, &f).await,
        before,
        "reading the store back changed it"
    );
    let rows = rows(&h, &f);
    assert!(rows.len() >= 60, "{} rows", rows.len());
    let names: BTreeSet<&str> = rows.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(names.len(), rows.len(), "two rows share a name");
    // Every row runs, and every row that fails is reported, at the end.
    let mut failures = Vec::new();
    for row in &rows {
        let too_large = row.body.len() > MAX_DECODE_BYTES;
        if matches!(row.expect, Transport) {
            assert!(too_large, "{}: fits the transport's limit", row.name);
        }
        let expect = if too_large { &Transport } else { &row.expect };
        let answer = call(h.addr, row).await;
        let created = check(row, expect, &answer).unwrap_or_else(|why| {
            failures.push(format!("{}: {why}", row.name));
            None
        });
        let after = snapshot(&h, &f).await;
        let (was, is) = match &created {
            None => (before.clone(), after.clone()),
            Some(id) => (before.without(id), after.without(id)),
        };
        if was != is {
            failures.push(format!(
                "{}: the store changed: {}",
                row.name,
                diff(&was, &is)
            ));
        }
        if let Some(id) = &created {
            let got = h.get(id).await.expect("the new permit reads back");
            assert_eq!(got.budget_reserved + got.budget_committed, 0);
        }
        // The next row is held to the store as it is now.
        before = after;
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows failed:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );
}

// === the table ===

/// What a row expects.
#[derive(Debug)]
enum Expect {
    /// Refused by atmost with this code and ErrorInfo reason.
    Refused(Code, &'static str),
    /// INVALID_ARGUMENT / INVALID_REQUEST, its BadRequest naming this field.
    Invalid(&'static str),
    /// Accepted, changing nothing; the answer names this (a canonical id).
    Read(Option<String>),
    /// A CreatePermit accepted: the new permit is all that changed, and it
    /// reads back as sent.
    Created,
    /// Refused by the transport before atmost saw it: the message is past
    /// the decode limit. RESOURCE_EXHAUSTED / MESSAGE_TOO_LARGE, the limit
    /// and the message's size in its metadata.
    Transport,
    /// Bytes that are not a message of the request's type: tonic's codec
    /// answers INTERNAL (gRPC's code for a parse error), no ErrorInfo.
    Undecodable,
    /// Answered before any handler of atmost's, by gRPC itself (a
    /// compression it does not accept) or by a service that is not
    /// atmost's (gRPC health): this code, no ErrorInfo.
    Unhandled(Code),
}

/// How a row's message is framed on its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// Uncompressed, as every client sends it.
    Plain,
    /// Marked compressed, with `grpc-encoding: gzip`.
    Gzip,
    /// Marked compressed, with no `grpc-encoding` to say how.
    FlagOnly,
}

struct Row {
    name: String,
    path: &'static str,
    /// The request message, encoded.
    body: Vec<u8>,
    framing: Framing,
    expect: Expect,
}

fn row(name: &str, path: &'static str, message: &impl Message, expect: Expect) -> Row {
    raw(name, path, message.encode_to_vec(), expect)
}

fn raw(name: &str, path: &'static str, body: Vec<u8>, expect: Expect) -> Row {
    Row {
        name: name.to_owned(),
        path,
        body,
        framing: Framing::Plain,
        expect,
    }
}

use Expect::{Created, Invalid, Read, Refused, Transport, Undecodable, Unhandled};

/// The forms one UUID may be written in, and forms that are not a UUID.
struct Forms {
    braced: String,
    urn: String,
    upper: String,
    simple: String,
    urn_upper: String,
    braced_simple: String,
    unbalanced: String,
    spaced: String,
    newline: String,
    misplaced: String,
    urn_simple: String,
    fullwidth: String,
    /// A different UUID: its last hex digit changed.
    other: String,
}

fn forms(id: &str) -> Forms {
    let simple = id.replace('-', "");
    let last = if id.ends_with('0') { '1' } else { '0' };
    Forms {
        braced: format!("{{{id}}}"),
        urn: format!("urn:uuid:{id}"),
        upper: id.to_uppercase(),
        urn_upper: format!("URN:UUID:{}", id.to_uppercase()),
        braced_simple: format!("{{{simple}}}"),
        unbalanced: format!("{{{id}"),
        spaced: format!(" {id} "),
        newline: format!("{id}\n"),
        // 4-8-4-4-12 instead of 8-4-4-4-12: 36 characters, hyphens astray.
        misplaced: format!(
            "{}-{}-{}-{}-{}",
            &simple[..4],
            &simple[4..12],
            &simple[12..16],
            &simple[16..20],
            &simple[20..]
        ),
        urn_simple: format!("urn:uuid:{simple}"),
        fullwidth: id.replacen(|c: char| c.is_ascii_digit(), "\u{ff10}", 1),
        other: format!("{}{last}", &id[..id.len() - 1]),
        simple,
    }
}

const NIL: &str = "00000000-0000-0000-0000-000000000000";

fn hex(text: &[u8]) -> String {
    text.iter().map(|b| format!("{b:02x}")).collect()
}

fn timestamp(seconds: i64, nanos: i32) -> Option<prost_types::Timestamp> {
    Some(prost_types::Timestamp { seconds, nanos })
}

fn duration(seconds: i64, nanos: i32) -> Option<prost_types::Duration> {
    Some(prost_types::Duration { seconds, nanos })
}

fn rows(h: &Harness, f: &Fixture) -> Vec<Row> {
    let mut rows = Vec::new();
    rows.extend(authorize_rows(f));
    rows.extend(commit_rows(f));
    rows.extend(mark_uncertain_rows(f));
    rows.extend(create_rows(h, f));
    rows.extend(permit_id_rows(f));
    rows.extend(get_attempt_rows(f));
    rows.extend(list_rows(f));
    rows.extend(resolve_rows(f));
    rows.extend(other_rows(f));
    rows
}

fn authorize_rows(f: &Fixture) -> Vec<Row> {
    // A new key that would dispatch: every row breaks it somewhere.
    let base = pb::AuthorizeRequest {
        permit_id: f.p.clone(),
        tool: "search".into(),
        idempotency_key: "campaign-new-key".into(),
        request_fingerprint: b"fp-campaign".to_vec(),
        cost: 1,
        holder_token: Vec::new(),
        ..Default::default()
    };
    let with = |edit: &dyn Fn(&mut pb::AuthorizeRequest)| {
        let mut r = base.clone();
        edit(&mut r);
        r
    };
    let replay = |permit_id: &str| pb::AuthorizeRequest {
        permit_id: permit_id.to_owned(),
        ..f.rereads[0].clone()
    };
    let p = forms(&f.p);
    vec![
        row(
            "authorize: permit_id of 100 KiB",
            AUTHORIZE,
            &with(&|r| r.permit_id = big(BIG)),
            Invalid("permit_id"),
        ),
        row(
            "authorize: empty permit_id",
            AUTHORIZE,
            &with(&|r| r.permit_id.clear()),
            Invalid("permit_id"),
        ),
        row(
            "authorize: permit_id of control characters",
            AUTHORIZE,
            &with(&|r| r.permit_id = CTRL.into()),
            Invalid("permit_id"),
        ),
        row(
            "authorize: tool of 100 KiB",
            AUTHORIZE,
            &with(&|r| r.tool = big(BIG)),
            Invalid("tool"),
        ),
        row(
            "authorize: tool of 1 MiB",
            AUTHORIZE,
            &with(&|r| r.tool = big(1 << 20)),
            Invalid("tool"),
        ),
        row(
            "authorize: tool of control characters",
            AUTHORIZE,
            &with(&|r| r.tool = CTRL.into()),
            Invalid("tool"),
        ),
        row(
            "authorize: idempotency_key of 100 KiB",
            AUTHORIZE,
            &with(&|r| r.idempotency_key = big(BIG)),
            Invalid("idempotency_key"),
        ),
        row(
            "authorize: idempotency_key of control characters",
            AUTHORIZE,
            &with(&|r| r.idempotency_key = CTRL.into()),
            Invalid("idempotency_key"),
        ),
        row(
            "authorize: empty fingerprint",
            AUTHORIZE,
            &with(&|r| r.request_fingerprint.clear()),
            Invalid("request_fingerprint"),
        ),
        row(
            "authorize: fingerprint of 100 KiB",
            AUTHORIZE,
            &with(&|r| r.request_fingerprint = vec![0xff; BIG]),
            Invalid("request_fingerprint"),
        ),
        row(
            "authorize: holder_token of 100 KiB",
            AUTHORIZE,
            &with(&|r| r.holder_token = vec![0; BIG]),
            Invalid("holder_token"),
        ),
        row(
            "authorize: every field oversized at once",
            AUTHORIZE,
            &pb::AuthorizeRequest {
                permit_id: big(MID),
                tool: big(MID),
                idempotency_key: big(MID),
                request_fingerprint: vec![1; MID],
                cost: -1,
                holder_token: vec![2; MID],
                ..Default::default()
            },
            Invalid("holder_token"),
        ),
        row(
            "authorize: cost -1",
            AUTHORIZE,
            &with(&|r| r.cost = -1),
            Invalid("cost"),
        ),
        row(
            "authorize: cost 2^53",
            AUTHORIZE,
            &with(&|r| r.cost = MAX_AMOUNT + 1),
            Invalid("cost"),
        ),
        row(
            "authorize: cost i64::MAX",
            AUTHORIZE,
            &with(&|r| r.cost = i64::MAX),
            Invalid("cost"),
        ),
        row(
            "authorize: cost i64::MIN",
            AUTHORIZE,
            &with(&|r| r.cost = i64::MIN),
            Invalid("cost"),
        ),
        row(
            "authorize: cost 2^53-1 past the permit's budget",
            AUTHORIZE,
            &with(&|r| r.cost = MAX_AMOUNT),
            Refused(Code::ResourceExhausted, "PERMIT_BUDGET_EXCEEDED"),
        ),
        row(
            "authorize: cost 2^53-1 past the ceiling of a permit without budget",
            AUTHORIZE,
            &pb::AuthorizeRequest {
                permit_id: f.q.clone(),
                tool: "t".into(),
                cost: MAX_AMOUNT,
                ..base.clone()
            },
            Refused(Code::ResourceExhausted, "PERMIT_BUDGET_EXCEEDED"),
        ),
        row(
            "authorize: a tool not in scope",
            AUTHORIZE,
            &with(&|r| r.tool = "not-in-scope".into()),
            Refused(Code::PermissionDenied, "TOOL_NOT_IN_SCOPE"),
        ),
        row(
            "authorize: a known key with another request",
            AUTHORIZE,
            &pb::AuthorizeRequest {
                request_fingerprint: b"another request".to_vec(),
                ..f.rereads[0].clone()
            },
            Refused(Code::FailedPrecondition, "IDEMPOTENCY_KEY_REUSED"),
        ),
        row(
            "authorize: a RESERVED key with another holder token",
            AUTHORIZE,
            &pb::AuthorizeRequest {
                holder_token: b"not the holder".to_vec(),
                ..f.rereads[2].clone()
            },
            Refused(Code::Aborted, "IDEMPOTENCY_IN_PROGRESS"),
        ),
        row(
            "authorize: the nil UUID",
            AUTHORIZE,
            &with(&|r| r.permit_id = NIL.into()),
            Refused(Code::NotFound, "PERMIT_NOT_FOUND"),
        ),
        row(
            "authorize: a revoked permit",
            AUTHORIZE,
            &pb::AuthorizeRequest {
                permit_id: f.r.clone(),
                tool: "t".into(),
                ..base.clone()
            },
            Refused(Code::FailedPrecondition, "PERMIT_REVOKED"),
        ),
        row(
            "authorize: replay, permit_id braced",
            AUTHORIZE,
            &replay(&p.braced),
            Read(Some(f.p.clone())),
        ),
        row(
            "authorize: replay, permit_id as a URN in upper case",
            AUTHORIZE,
            &replay(&p.urn_upper),
            Read(Some(f.p.clone())),
        ),
        row(
            "authorize: replay, permit_id of 32 hex digits",
            AUTHORIZE,
            &replay(&p.simple),
            Read(Some(f.p.clone())),
        ),
    ]
}

fn commit_rows(f: &Fixture) -> Vec<Row> {
    use pb::commit_request::Outcome;
    // Fails the RESERVED attempt: every row breaks it somewhere.
    let base = pb::CommitRequest {
        permit_id: f.p.clone(),
        idempotency_key: f.reserved.idempotency_key.clone(),
        attempt_id: f.reserved.attempt_id.clone(),
        outcome: Some(failed("campaign")),
    };
    let with = |edit: &dyn Fn(&mut pb::CommitRequest)| {
        let mut r = base.clone();
        edit(&mut r);
        r
    };
    let on = |a: &pb::Attempt, outcome: Outcome| pb::CommitRequest {
        permit_id: a.permit_id.clone(),
        idempotency_key: a.idempotency_key.clone(),
        attempt_id: a.attempt_id.clone(),
        outcome: Some(outcome),
    };
    vec![
        row(
            "commit: permit_id of 100 KiB",
            COMMIT,
            &with(&|r| r.permit_id = big(BIG)),
            Invalid("permit_id"),
        ),
        row(
            "commit: permit_id of control characters",
            COMMIT,
            &with(&|r| r.permit_id = CTRL.into()),
            Invalid("permit_id"),
        ),
        row(
            "commit: idempotency_key of 100 KiB",
            COMMIT,
            &with(&|r| r.idempotency_key = big(BIG)),
            Invalid("idempotency_key"),
        ),
        row(
            "commit: idempotency_key of control characters",
            COMMIT,
            &with(&|r| r.idempotency_key = CTRL.into()),
            Invalid("idempotency_key"),
        ),
        row(
            "commit: attempt_id of 100 KiB",
            COMMIT,
            &with(&|r| r.attempt_id = big(BIG)),
            Invalid("attempt_id"),
        ),
        row(
            "commit: empty attempt_id",
            COMMIT,
            &with(&|r| r.attempt_id.clear()),
            Invalid("attempt_id"),
        ),
        row(
            "commit: attempt_id of control characters",
            COMMIT,
            &with(&|r| r.attempt_id = CTRL.into()),
            Invalid("attempt_id"),
        ),
        row(
            "commit: failure reason of 100 KiB",
            COMMIT,
            &with(&|r| r.outcome = Some(failed(&big(BIG)))),
            Invalid("failed.reason"),
        ),
        row(
            "commit: every field oversized at once",
            COMMIT,
            &pb::CommitRequest {
                permit_id: big(MID),
                idempotency_key: big(MID),
                attempt_id: big(MID),
                outcome: Some(failed(&big(MID))),
            },
            Invalid("failed.reason"),
        ),
        row(
            "commit: a result of 64 KiB + 1",
            COMMIT,
            &with(&|r| r.outcome = Some(succeeded(&vec![7; 64 * 1024 + 1], None))),
            Invalid("succeeded.result"),
        ),
        row(
            "commit: a result of 64 KiB onto a SUCCEEDED attempt",
            COMMIT,
            &on(&f.succeeded, succeeded(&vec![7; 64 * 1024], None)),
            Refused(Code::FailedPrecondition, "ATTEMPT_STATE_CONFLICT"),
        ),
        row(
            "commit: no outcome",
            COMMIT,
            &with(&|r| r.outcome = None),
            Invalid("outcome"),
        ),
        row(
            "commit: actual_cost 2^53",
            COMMIT,
            &with(&|r| r.outcome = Some(succeeded(b"r", Some(MAX_AMOUNT + 1)))),
            Invalid("succeeded.actual_cost"),
        ),
        row(
            "commit: actual_cost -1",
            COMMIT,
            &with(&|r| r.outcome = Some(succeeded(b"r", Some(-1)))),
            Invalid("succeeded.actual_cost"),
        ),
        row(
            "commit: actual_cost 2^53-1, past the reserved cost",
            COMMIT,
            &with(&|r| r.outcome = Some(succeeded(b"r", Some(MAX_AMOUNT)))),
            Invalid("succeeded.actual_cost"),
        ),
        row(
            "commit: another attempt's id",
            COMMIT,
            &with(&|r| r.attempt_id = f.failed.attempt_id.clone()),
            Refused(Code::FailedPrecondition, "ATTEMPT_MISMATCH"),
        ),
        row(
            "commit: an unknown key",
            COMMIT,
            &with(&|r| r.idempotency_key = "no-such-key".into()),
            Refused(Code::NotFound, "ATTEMPT_NOT_FOUND"),
        ),
        row(
            "commit: not_sent onto an UNCERTAIN attempt",
            COMMIT,
            &on(&f.uncertain, not_sent()),
            Refused(Code::FailedPrecondition, "ATTEMPT_STATE_CONFLICT"),
        ),
        row(
            "commit: the recorded control-character failure again, attempt_id in upper case",
            COMMIT,
            &pb::CommitRequest {
                attempt_id: f.failed.attempt_id.to_uppercase(),
                ..on(&f.failed, failed(CTRL))
            },
            Read(Some(f.failed.attempt_id.clone())),
        ),
    ]
}

fn mark_uncertain_rows(f: &Fixture) -> Vec<Row> {
    let base = pb::MarkUncertainRequest {
        permit_id: f.p.clone(),
        idempotency_key: f.uncertain.idempotency_key.clone(),
        attempt_id: f.uncertain.attempt_id.clone(),
        reason: "campaign".into(),
    };
    let with = |edit: &dyn Fn(&mut pb::MarkUncertainRequest)| {
        let mut r = base.clone();
        edit(&mut r);
        r
    };
    vec![
        row(
            "mark_uncertain: permit_id of 100 KiB",
            MARK_UNCERTAIN,
            &with(&|r| r.permit_id = big(BIG)),
            Invalid("permit_id"),
        ),
        row(
            "mark_uncertain: permit_id of control characters",
            MARK_UNCERTAIN,
            &with(&|r| r.permit_id = CTRL.into()),
            Invalid("permit_id"),
        ),
        row(
            "mark_uncertain: idempotency_key of 100 KiB",
            MARK_UNCERTAIN,
            &with(&|r| r.idempotency_key = big(BIG)),
            Invalid("idempotency_key"),
        ),
        row(
            "mark_uncertain: idempotency_key of control characters",
            MARK_UNCERTAIN,
            &with(&|r| r.idempotency_key = CTRL.into()),
            Invalid("idempotency_key"),
        ),
        row(
            "mark_uncertain: attempt_id of 100 KiB",
            MARK_UNCERTAIN,
            &with(&|r| r.attempt_id = big(BIG)),
            Invalid("attempt_id"),
        ),
        row(
            "mark_uncertain: attempt_id of control characters",
            MARK_UNCERTAIN,
            &with(&|r| r.attempt_id = CTRL.into()),
            Invalid("attempt_id"),
        ),
        row(
            "mark_uncertain: reason of 100 KiB",
            MARK_UNCERTAIN,
            &with(&|r| r.reason = big(BIG)),
            Invalid("reason"),
        ),
        row(
            "mark_uncertain: a SUCCEEDED attempt",
            MARK_UNCERTAIN,
            &pb::MarkUncertainRequest {
                idempotency_key: f.succeeded.idempotency_key.clone(),
                attempt_id: f.succeeded.attempt_id.clone(),
                ..base.clone()
            },
            Refused(Code::FailedPrecondition, "ATTEMPT_STATE_CONFLICT"),
        ),
        row(
            "mark_uncertain: control-character reason onto an UNCERTAIN attempt",
            MARK_UNCERTAIN,
            &with(&|r| r.reason = CTRL.into()),
            Read(Some(f.uncertain.attempt_id.clone())),
        ),
        row(
            "mark_uncertain: attempt_id braced, an UNCERTAIN attempt",
            MARK_UNCERTAIN,
            &with(&|r| r.attempt_id = format!("{{{}}}", f.uncertain.attempt_id)),
            Read(Some(f.uncertain.attempt_id.clone())),
        ),
    ]
}

fn create_rows(h: &Harness, f: &Fixture) -> Vec<Row> {
    let base = h.permit(&["a"]);
    let create = |edit: &dyn Fn(&mut pb::Permit)| {
        let mut p = base.clone();
        edit(&mut p);
        pb::CreatePermitRequest { permit: Some(p) }
    };
    let now_s = h.now_ms() / 1000;
    vec![
        row(
            "create: no permit",
            CREATE,
            &pb::CreatePermitRequest { permit: None },
            Invalid("permit"),
        ),
        row(
            "create: another permit's id",
            CREATE,
            &create(&|p| p.permit_id = f.p.clone()),
            Invalid("permit.permit_id"),
        ),
        row(
            "create: permit_id of 100 KiB",
            CREATE,
            &create(&|p| p.permit_id = big(BIG)),
            Invalid("permit.permit_id"),
        ),
        row(
            "create: subject of 100 KiB",
            CREATE,
            &create(&|p| p.subject = big(BIG)),
            Invalid("permit.subject"),
        ),
        row(
            "create: subject of control characters",
            CREATE,
            &create(&|p| p.subject = CTRL.into()),
            Created,
        ),
        row(
            "create: currency of 100 KiB",
            CREATE,
            &create(&|p| p.currency = big(BIG)),
            Invalid("permit.currency"),
        ),
        row(
            "create: currency of control characters",
            CREATE,
            &create(&|p| p.currency = CTRL.into()),
            Created,
        ),
        row(
            "create: no tools",
            CREATE,
            &create(&|p| p.tools.clear()),
            Invalid("permit.tools"),
        ),
        row(
            "create: a tool of 100 KiB",
            CREATE,
            &create(&|p| p.tools.push(big(BIG))),
            Invalid("permit.tools"),
        ),
        row(
            "create: a tool of control characters",
            CREATE,
            &create(&|p| p.tools.push(CTRL.into())),
            Invalid("permit.tools"),
        ),
        row(
            "create: an empty tool",
            CREATE,
            &create(&|p| p.tools.push(String::new())),
            Invalid("permit.tools"),
        ),
        row(
            "create: a tool listed twice",
            CREATE,
            &create(&|p| p.tools.push("a".into())),
            Invalid("permit.tools"),
        ),
        row(
            "create: 257 tools",
            CREATE,
            &create(&|p| p.tools = (0..257).map(|i| format!("t{i}")).collect()),
            Invalid("permit.tools"),
        ),
        row(
            "create: 256 tools of 128 bytes, each capped: at every limit",
            CREATE,
            &create(&|p| {
                p.tools = (0..256).map(|i| format!("{i:0>128}")).collect();
                p.max_calls_per_tool = p.tools.iter().map(|t| (t.clone(), 1)).collect();
            }),
            Created,
        ),
        row(
            "create: one tool listed 300 times",
            CREATE,
            &create(&|p| p.tools = vec!["a".into(); 300]),
            Invalid("permit.tools"),
        ),
        row(
            "create: malformed tools",
            CREATE,
            &create(&|p| {
                p.tools = ["a b", "é", "tab\t", "semi;colon", "quote\"", "a"]
                    .map(String::from)
                    .to_vec()
            }),
            Invalid("permit.tools"),
        ),
        row(
            "create: 20,000 malformed tools",
            CREATE,
            &create(&|p| p.tools = vec!["a b".into(); 20_000]),
            Invalid("permit.tools"),
        ),
        row(
            "create: 100,000 caps",
            CREATE,
            &create(&|p| {
                p.max_calls_per_tool = (0..100_000).map(|i| (format!("t{i}"), 1)).collect()
            }),
            Invalid("permit.max_calls_per_tool"),
        ),
        row(
            "create: a cap on a tool of 100 KiB",
            CREATE,
            &create(&|p| {
                p.max_calls_per_tool.insert(big(BIG), 1);
            }),
            Invalid("permit.max_calls_per_tool"),
        ),
        row(
            "create: a cap on a tool of control characters",
            CREATE,
            &create(&|p| {
                p.max_calls_per_tool.insert(CTRL.into(), 1);
            }),
            Invalid("permit.max_calls_per_tool"),
        ),
        row(
            "create: a cap of 2^53",
            CREATE,
            &create(&|p| {
                p.max_calls_per_tool.insert("a".into(), 1 << 53);
            }),
            Invalid("permit.max_calls_per_tool"),
        ),
        row(
            "create: a cap of u64::MAX",
            CREATE,
            &create(&|p| {
                p.max_calls_per_tool.insert("a".into(), u64::MAX);
            }),
            Invalid("permit.max_calls_per_tool"),
        ),
        row(
            "create: a budget of 2^53",
            CREATE,
            &create(&|p| p.budget = Some(MAX_AMOUNT + 1)),
            Invalid("permit.budget"),
        ),
        row(
            "create: a budget of -1",
            CREATE,
            &create(&|p| p.budget = Some(-1)),
            Invalid("permit.budget"),
        ),
        row(
            "create: a budget of i64::MIN",
            CREATE,
            &create(&|p| p.budget = Some(i64::MIN)),
            Invalid("permit.budget"),
        ),
        row(
            "create: a budget and a cap of 2^53-1",
            CREATE,
            &create(&|p| {
                p.budget = Some(MAX_AMOUNT);
                p.max_calls_per_tool.insert("a".into(), MAX_AMOUNT as u64);
            }),
            Created,
        ),
        row(
            "create: an agent of 100 KiB",
            CREATE,
            &create(&|p| p.agents.push(big(BIG))),
            Invalid("permit.agents"),
        ),
        row(
            "create: an agent of control characters",
            CREATE,
            &create(&|p| p.agents.push(CTRL.into())),
            Invalid("permit.agents"),
        ),
        row(
            "create: 65 agents",
            CREATE,
            &create(&|p| p.agents = (0..65).map(|i| format!("agent-{i}")).collect()),
            Invalid("permit.agents"),
        ),
        row(
            "create: an agent listed twice",
            CREATE,
            &create(&|p| p.agents = vec!["agent".into(); 2]),
            Invalid("permit.agents"),
        ),
        row(
            "create: a tenant of 100 KiB",
            CREATE,
            &create(&|p| p.tenant = big(BIG)),
            Invalid("permit.status"),
        ),
        row(
            "create: a tenant of control characters",
            CREATE,
            &create(&|p| p.tenant = CTRL.into()),
            Invalid("permit.status"),
        ),
        row(
            "create: a status",
            CREATE,
            &create(&|p| p.status = pb::PermitStatus::Active as i32),
            Invalid("permit.status"),
        ),
        row(
            "create: a creation time",
            CREATE,
            &create(&|p| p.created_at = timestamp(now_s, 0)),
            Invalid("permit.status"),
        ),
        row(
            "create: every string field oversized at once",
            CREATE,
            &create(&|p| {
                p.permit_id = big(MID);
                p.subject = big(MID);
                p.currency = big(MID);
                p.tools = vec![big(MID)];
                p.max_calls_per_tool.insert(big(MID + 1), 1);
                p.agents = vec![big(MID)];
                p.tenant = big(MID);
            }),
            Invalid("permit.subject"),
        ),
        row(
            "create: no expiry",
            CREATE,
            &create(&|p| p.expires_at = None),
            Invalid("permit.expires_at"),
        ),
        row(
            "create: expiry at negative seconds",
            CREATE,
            &create(&|p| p.expires_at = timestamp(-1, 0)),
            Invalid("permit.expires_at"),
        ),
        row(
            "create: expiry with nanos 1e9",
            CREATE,
            &create(&|p| p.expires_at = timestamp(now_s + 3600, 1_000_000_000)),
            Invalid("permit.expires_at"),
        ),
        row(
            "create: expiry with nanos -1",
            CREATE,
            &create(&|p| p.expires_at = timestamp(now_s + 3600, -1)),
            Invalid("permit.expires_at"),
        ),
        row(
            "create: expiry in the year 10000",
            CREATE,
            // 10000-01-01T00:00:00Z
            &create(&|p| p.expires_at = timestamp(253_402_300_800, 0)),
            Invalid("permit.expires_at"),
        ),
        row(
            "create: expiry at i64::MAX seconds",
            CREATE,
            &create(&|p| p.expires_at = timestamp(i64::MAX, 999_999_999)),
            Invalid("permit.expires_at"),
        ),
        row(
            "create: expiry in the past",
            CREATE,
            &create(&|p| p.expires_at = timestamp(now_s - 1, 0)),
            Invalid("permit.expires_at"),
        ),
        row(
            "create: a negative lease",
            CREATE,
            &create(&|p| p.lease = duration(-30, 0)),
            Invalid("permit.lease"),
        ),
        row(
            "create: a lease with nanos 1e9",
            CREATE,
            &create(&|p| p.lease = duration(30, 1_000_000_000)),
            Invalid("permit.lease"),
        ),
        row(
            "create: a lease with nanos -1",
            CREATE,
            &create(&|p| p.lease = duration(30, -1)),
            Invalid("permit.lease"),
        ),
        row(
            "create: a lease of zero",
            CREATE,
            &create(&|p| p.lease = duration(0, 0)),
            Invalid("permit.lease"),
        ),
        row(
            "create: a lease under a millisecond",
            CREATE,
            &create(&|p| p.lease = duration(0, 999_999)),
            Invalid("permit.lease"),
        ),
        row(
            "create: a lease of 7 days + 1 s",
            CREATE,
            &create(&|p| p.lease = duration(7 * 24 * 3600 + 1, 0)),
            Invalid("permit.lease"),
        ),
        row(
            "create: a lease of 7 days and 999,999,999 ns",
            CREATE,
            &create(&|p| p.lease = duration(7 * 24 * 3600, 999_999_999)),
            Invalid("permit.lease"),
        ),
        row(
            "create: a lease of i64::MAX seconds",
            CREATE,
            &create(&|p| p.lease = duration(i64::MAX, 0)),
            Invalid("permit.lease"),
        ),
        row(
            "create: a negative duplicate window",
            CREATE,
            &create(&|p| {
                p.duplicate_guard = Some(pb::DuplicateGuard {
                    mode: pb::DuplicateGuardMode::Log as i32,
                    window: duration(-1, 0),
                })
            }),
            Invalid("permit.duplicate_guard.window"),
        ),
        row(
            "create: a duplicate window with nanos 1e9",
            CREATE,
            &create(&|p| {
                p.duplicate_guard = Some(pb::DuplicateGuard {
                    mode: pb::DuplicateGuardMode::Log as i32,
                    window: duration(60, 1_000_000_000),
                })
            }),
            Invalid("permit.duplicate_guard.window"),
        ),
        row(
            "create: an unknown duplicate guard mode",
            CREATE,
            &create(&|p| {
                p.duplicate_guard = Some(pb::DuplicateGuard {
                    mode: 99,
                    window: None,
                })
            }),
            Invalid("permit.duplicate_guard.mode"),
        ),
        row(
            "create: an unknown uncertain policy",
            CREATE,
            &create(&|p| p.uncertain_policy = -1),
            Invalid("permit.uncertain_policy"),
        ),
    ]
}

/// GetAttempt: the known keys read back in any form of the permit's id;
/// hostile keys and ids refused; unknown ones not found.
fn get_attempt_rows(f: &Fixture) -> Vec<Row> {
    let get = |permit_id: &str, key: &str| pb::GetAttemptRequest {
        permit_id: permit_id.to_owned(),
        idempotency_key: key.to_owned(),
    };
    let p = forms(&f.p);
    let key = f.succeeded.idempotency_key.as_str();
    let read = |a: &pb::Attempt| Read(Some(a.attempt_id.clone()));
    vec![
        row(
            "get attempt: the SUCCEEDED key",
            GET_ATTEMPT,
            &get(&f.p, key),
            read(&f.succeeded),
        ),
        // An open attempt's id is its fencing token: GetAttempt withholds it
        // (behaviour::get_attempt checks that), so the answer names the key.
        row(
            "get attempt: the RESERVED key, held by its holder",
            GET_ATTEMPT,
            &get(&f.reserved.permit_id, &f.reserved.idempotency_key),
            Read(Some(f.reserved.idempotency_key.clone())),
        ),
        row(
            "get attempt: the UNCERTAIN key, marked with control characters",
            GET_ATTEMPT,
            &get(&f.uncertain.permit_id, &f.uncertain.idempotency_key),
            read(&f.uncertain),
        ),
        row(
            "get attempt: the permit as a URN in upper case",
            GET_ATTEMPT,
            &get(&p.urn_upper, key),
            read(&f.succeeded),
        ),
        row(
            "get attempt: key of 100 KiB",
            GET_ATTEMPT,
            &get(&f.p, &big(BIG)),
            Invalid("idempotency_key"),
        ),
        row(
            "get attempt: key of control characters",
            GET_ATTEMPT,
            &get(&f.p, CTRL),
            Invalid("idempotency_key"),
        ),
        row(
            "get attempt: an empty key",
            GET_ATTEMPT,
            &get(&f.p, ""),
            Invalid("idempotency_key"),
        ),
        row(
            "get attempt: permit_id of control characters",
            GET_ATTEMPT,
            &get(CTRL, key),
            Invalid("permit_id"),
        ),
        row(
            "get attempt: an empty request",
            GET_ATTEMPT,
            &pb::GetAttemptRequest::default(),
            Invalid("permit_id"),
        ),
        row(
            "get attempt: another UUID, one digit off",
            GET_ATTEMPT,
            &get(&p.other, key),
            Refused(Code::NotFound, "PERMIT_NOT_FOUND"),
        ),
        row(
            "get attempt: a key the permit never saw",
            GET_ATTEMPT,
            &get(&f.p, "campaign-never-seen"),
            Refused(Code::NotFound, "ATTEMPT_NOT_FOUND"),
        ),
        row(
            "get attempt: a key of P asked of Q",
            GET_ATTEMPT,
            &get(&f.q, key),
            Refused(Code::NotFound, "ATTEMPT_NOT_FOUND"),
        ),
    ]
}

/// GetPermit and RevokePermit: permit ids in every form.
fn permit_id_rows(f: &Fixture) -> Vec<Row> {
    let get = |id: &str| pb::GetPermitRequest {
        permit_id: id.to_owned(),
    };
    let p = forms(&f.p);
    let found = || Read(Some(f.p.clone()));
    let invalid = || Invalid("permit_id");
    let mut with_unknown_field = get(&f.p).encode_to_vec();
    // Field 99, length-delimited, 100 KiB: unknown to atmost, skipped.
    with_unknown_field.extend([0x9a, 0x06]);
    prost::encoding::encode_varint(BIG as u64, &mut with_unknown_field);
    with_unknown_field.extend(vec![b'x'; BIG]);
    vec![
        row("get: permit_id of 100 KiB", GET, &get(&big(BIG)), invalid()),
        row(
            "get: permit_id of 1 MiB",
            GET,
            &get(&big(1 << 20)),
            invalid(),
        ),
        row(
            "get: permit_id of control characters",
            GET,
            &get(CTRL),
            invalid(),
        ),
        row("get: permit_id braced", GET, &get(&p.braced), found()),
        row("get: permit_id as a URN", GET, &get(&p.urn), found()),
        row("get: permit_id in upper case", GET, &get(&p.upper), found()),
        row(
            "get: permit_id of 32 hex digits",
            GET,
            &get(&p.simple),
            found(),
        ),
        row(
            "get: permit_id as a URN in upper case",
            GET,
            &get(&p.urn_upper),
            found(),
        ),
        row(
            "get: permit_id of 32 hex digits, braced",
            GET,
            &get(&p.braced_simple),
            invalid(),
        ),
        row(
            "get: permit_id with one brace",
            GET,
            &get(&p.unbalanced),
            invalid(),
        ),
        row(
            "get: permit_id between spaces",
            GET,
            &get(&p.spaced),
            invalid(),
        ),
        row(
            "get: permit_id and a newline",
            GET,
            &get(&p.newline),
            invalid(),
        ),
        row(
            "get: permit_id with hyphens astray",
            GET,
            &get(&p.misplaced),
            invalid(),
        ),
        row(
            "get: permit_id as a URN of 32 hex digits",
            GET,
            &get(&p.urn_simple),
            invalid(),
        ),
        row(
            "get: permit_id with a full-width digit",
            GET,
            &get(&p.fullwidth),
            invalid(),
        ),
        row(
            "get: another UUID, one digit off",
            GET,
            &get(&p.other),
            Refused(Code::NotFound, "PERMIT_NOT_FOUND"),
        ),
        row(
            "get: the nil UUID",
            GET,
            &get(NIL),
            Refused(Code::NotFound, "PERMIT_NOT_FOUND"),
        ),
        raw(
            "get: an unknown field of 100 KiB",
            GET,
            with_unknown_field,
            found(),
        ),
        row(
            "revoke: permit_id of 100 KiB",
            REVOKE,
            &pb::RevokePermitRequest {
                permit_id: big(BIG),
            },
            invalid(),
        ),
        row(
            "revoke: permit_id of control characters",
            REVOKE,
            &pb::RevokePermitRequest {
                permit_id: CTRL.into(),
            },
            invalid(),
        ),
        row(
            "revoke: the nil UUID",
            REVOKE,
            &pb::RevokePermitRequest {
                permit_id: NIL.into(),
            },
            Refused(Code::NotFound, "PERMIT_NOT_FOUND"),
        ),
        row(
            "revoke: a revoked permit again, braced in upper case",
            REVOKE,
            &pb::RevokePermitRequest {
                permit_id: format!("{{{}}}", f.r.to_uppercase()),
            },
            Read(Some(f.r.clone())),
        ),
    ]
}

fn list_rows(f: &Fixture) -> Vec<Row> {
    let list = |permit_id: &str, token: &str| pb::ListUncertainRequest {
        permit_id: permit_id.to_owned(),
        page_size: 1,
        page_token: token.to_owned(),
    };
    let bad_token = || Invalid("page_token");
    // Well formed, but never answered: past every permit there is.
    let forged =
        hex(format!("2{}ffffffff-ffff-ffff-ffff-ffffffffffff~", "9".repeat(15)).as_bytes());
    // Well formed, inside P before its first uncertain attempt.
    let forged_inside = hex(format!("2{:015}{}~", 1, f.p).as_bytes());
    // A cursor inside P whose key is not one: a control character.
    let control_key = hex(format!("2{:015}{}\u{1}", 1, f.p).as_bytes());
    vec![
        row(
            "list: permit_id of 100 KiB",
            LIST,
            &list(&big(BIG), ""),
            Invalid("permit_id"),
        ),
        row(
            "list: permit_id of control characters",
            LIST,
            &list(CTRL, ""),
            Invalid("permit_id"),
        ),
        row(
            "list: a garbage page token",
            LIST,
            &list(&f.p, "not-a-page-token"),
            bad_token(),
        ),
        row(
            "list: a page token of control characters",
            LIST,
            &list(&f.p, CTRL),
            bad_token(),
        ),
        row(
            "list: a page token of 64 KiB",
            LIST,
            &list(&f.p, &"00".repeat(32 * 1024)),
            bad_token(),
        ),
        row(
            "list: a page token of 4 MiB",
            LIST,
            &list(&f.p, &"00".repeat(2 << 20)),
            Transport,
        ),
        row(
            "list: a page token with a control character in its key",
            LIST,
            &list(&f.p, &control_key),
            bad_token(),
        ),
        row(
            "list: another permit's page token",
            LIST,
            &list(&f.p, &f.q_token),
            bad_token(),
        ),
        row(
            "list: another permit's page token, across permits",
            LIST,
            &list("", &f.q_token),
            Read(Some(f.q.clone())),
        ),
        row(
            "list: the permit's page token, permit_id as a URN",
            LIST,
            &list(&format!("urn:uuid:{}", f.p), &f.p_token),
            Read(Some(f.p.clone())),
        ),
        row(
            "list: a forged page token inside the permit",
            LIST,
            &list(&f.p, &forged_inside),
            Read(Some(f.p.clone())),
        ),
        row(
            "list: a forged page token past everything",
            LIST,
            &list("", &forged),
            Read(None),
        ),
        row(
            "list: page_size 1001",
            LIST,
            &pb::ListUncertainRequest {
                page_size: 1001,
                ..list(&f.p, "")
            },
            Invalid("page_size"),
        ),
        row(
            "list: page_size u32::MAX",
            LIST,
            &pb::ListUncertainRequest {
                page_size: u32::MAX,
                ..list(&f.p, "")
            },
            Invalid("page_size"),
        ),
    ]
}

fn resolve_rows(f: &Fixture) -> Vec<Row> {
    use pb::resolve_request::Outcome;
    // Settles the UNCERTAIN attempt: every row breaks it somewhere.
    let base = pb::ResolveRequest {
        permit_id: f.p.clone(),
        idempotency_key: f.uncertain.idempotency_key.clone(),
        attempt_id: f.uncertain.attempt_id.clone(),
        outcome: Some(resolved_failed("campaign")),
    };
    let with = |edit: &dyn Fn(&mut pb::ResolveRequest)| {
        let mut r = base.clone();
        edit(&mut r);
        r
    };
    vec![
        row(
            "resolve: permit_id of 100 KiB",
            RESOLVE,
            &with(&|r| r.permit_id = big(BIG)),
            Invalid("permit_id"),
        ),
        row(
            "resolve: permit_id of control characters",
            RESOLVE,
            &with(&|r| r.permit_id = CTRL.into()),
            Invalid("permit_id"),
        ),
        row(
            "resolve: idempotency_key of 100 KiB",
            RESOLVE,
            &with(&|r| r.idempotency_key = big(BIG)),
            Invalid("idempotency_key"),
        ),
        row(
            "resolve: idempotency_key of control characters",
            RESOLVE,
            &with(&|r| r.idempotency_key = CTRL.into()),
            Invalid("idempotency_key"),
        ),
        row(
            "resolve: attempt_id of 100 KiB",
            RESOLVE,
            &with(&|r| r.attempt_id = big(BIG)),
            Invalid("attempt_id"),
        ),
        row(
            "resolve: attempt_id of control characters",
            RESOLVE,
            &with(&|r| r.attempt_id = CTRL.into()),
            Invalid("attempt_id"),
        ),
        row(
            "resolve: failure reason of 100 KiB",
            RESOLVE,
            &with(&|r| r.outcome = Some(resolved_failed(&big(BIG)))),
            Invalid("failed.reason"),
        ),
        row(
            "resolve: a result of 64 KiB + 1",
            RESOLVE,
            &with(&|r| r.outcome = Some(resolved_succeeded(&vec![7; 64 * 1024 + 1], None))),
            Invalid("succeeded.result"),
        ),
        row(
            "resolve: actual_cost 2^53",
            RESOLVE,
            &with(&|r| r.outcome = Some(resolved_succeeded(b"r", Some(MAX_AMOUNT + 1)))),
            Invalid("succeeded.actual_cost"),
        ),
        row(
            "resolve: no outcome",
            RESOLVE,
            &with(&|r| r.outcome = None),
            Invalid("outcome"),
        ),
        row(
            "resolve: not_sent without an attempt_id",
            RESOLVE,
            &with(&|r| {
                r.attempt_id.clear();
                r.outcome = Some(Outcome::NotSent(pb::NotSent {}));
            }),
            Invalid("attempt_id"),
        ),
        row(
            "resolve: a RESERVED attempt",
            RESOLVE,
            &pb::ResolveRequest {
                idempotency_key: f.reserved.idempotency_key.clone(),
                attempt_id: f.reserved.attempt_id.clone(),
                ..base.clone()
            },
            Refused(Code::FailedPrecondition, "ATTEMPT_STATE_CONFLICT"),
        ),
        row(
            "resolve: the recorded control-character failure again, permit_id as a URN",
            RESOLVE,
            &pb::ResolveRequest {
                permit_id: format!("urn:uuid:{}", f.p),
                idempotency_key: f.failed.idempotency_key.clone(),
                attempt_id: String::new(),
                outcome: Some(resolved_failed(CTRL)),
            },
            Read(Some(f.failed.attempt_id.clone())),
        ),
    ]
}

/// Health checks, and bytes that are not the request's message at all.
fn other_rows(f: &Fixture) -> Vec<Row> {
    use tonic_health::pb::HealthCheckRequest;
    let mut not_utf8 = f.rereads[0].encode_to_vec();
    // Field 2 (tool) again, length-delimited: two bytes that are not UTF-8.
    not_utf8.extend([0x12, 2, 0xff, 0xfe]);
    let mut truncated = pb::GetPermitRequest {
        permit_id: f.p.clone(),
    }
    .encode_to_vec();
    truncated.pop();
    // Start-group tags of field 99, 200 deep: past prost's recursion limit.
    let nested = [0x9b, 0x06].repeat(200);
    // Field 1 with wire type 7, which does not exist.
    let wire_type = vec![0x0f, 0];
    vec![
        row(
            "health: service of 100 KiB",
            HEALTH,
            &HealthCheckRequest { service: big(BIG) },
            Unhandled(Code::NotFound),
        ),
        row(
            "health: service of control characters",
            HEALTH,
            &HealthCheckRequest {
                service: CTRL.into(),
            },
            Unhandled(Code::NotFound),
        ),
        raw(
            "decode: a tool that is not UTF-8",
            AUTHORIZE,
            not_utf8,
            Undecodable,
        ),
        raw("decode: a truncated message", GET, truncated, Undecodable),
        Row {
            framing: Framing::Gzip,
            ..raw(
                "decode: a gzip-compressed message, never inflated",
                GET,
                vec![0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff],
                Unhandled(Code::Unimplemented),
            )
        },
        Row {
            framing: Framing::FlagOnly,
            ..raw(
                "decode: marked compressed, with no encoding",
                GET,
                pb::GetPermitRequest {
                    permit_id: f.p.clone(),
                }
                .encode_to_vec(),
                Undecodable,
            )
        },
        raw("decode: groups 200 deep", GET, nested, Undecodable),
        raw(
            "decode: an unknown wire type",
            CREATE,
            wire_type,
            Undecodable,
        ),
    ]
}

// === one call ===

/// What the server answered, as it came over the wire.
struct Answer {
    status: tonic::Status,
    /// `grpc-message` plus `grpc-status-details-bin`, as sent.
    error_bytes: usize,
    /// The response message (an accepted call's).
    message: Vec<u8>,
}

/// One unary call of `row` over a raw HTTP/2 stream of its own: any bytes
/// go, and the error is measured as sent.
async fn call(addr: std::net::SocketAddr, row: &Row) -> Answer {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (mut h2, connection) = h2::client::handshake(tcp).await.expect("HTTP/2");
    tokio::spawn(connection);
    let mut request = http::Request::builder()
        .method("POST")
        .uri(format!("http://{addr}{}", row.path))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if row.framing == Framing::Gzip {
        request = request.header("grpc-encoding", "gzip");
    }
    let request = request.body(()).expect("request");
    let (response, mut send) = h2.send_request(request, false).expect("send");
    let body = &row.body;
    let mut frame = Vec::with_capacity(5 + body.len());
    frame.push(u8::from(row.framing != Framing::Plain));
    frame.extend(
        u32::try_from(body.len())
            .expect("under 4 GiB")
            .to_be_bytes(),
    );
    frame.extend_from_slice(body);
    // The server may answer, and close the stream, before the message is
    // sent (a compression it refuses): its answer is what counts.
    let _ = send.send_data(bytes::Bytes::from(frame), true);
    let (head, mut received) = response.await.expect("response").into_parts();
    let mut message = Vec::new();
    while let Some(chunk) = received.data().await {
        let chunk = chunk.expect("body");
        let _ = received.flow_control().release_capacity(chunk.len());
        message.extend_from_slice(&chunk);
    }
    let trailers = received
        .trailers()
        .await
        .expect("trailers")
        .unwrap_or_default();
    // A trailers-only answer carries its status in the headers.
    let headers = if trailers.contains_key("grpc-status") {
        &trailers
    } else {
        &head.headers
    };
    let status = tonic::Status::from_header_map(headers).expect("a grpc-status");
    let error_bytes = ["grpc-message", "grpc-status-details-bin"]
        .iter()
        .map(|name| headers.get(*name).map_or(0, |v| v.len()))
        .sum();
    Answer {
        status,
        error_bytes,
        message: message.get(5..).unwrap_or_default().to_vec(),
    }
}

/// Checks one answer against what its row expects; returns the id of the
/// permit a CreatePermit created.
/// Fails with `why` unless `ok`.
macro_rules! ensure {
    ($ok:expr, $($why:tt)+) => {
        if !$ok {
            return Err(format!($($why)+));
        }
    };
}

/// Checks one answer against what its row expects; returns the id of the
/// permit a CreatePermit created.
fn check(row: &Row, expect: &Expect, answer: &Answer) -> Result<Option<String>, String> {
    let error = Error::from(answer.status.clone());
    let (code, reason) = (error.code(), error.reason_name());
    if code != Code::Ok {
        ensure!(
            answer.error_bytes < ERROR_BUDGET,
            "an error of {} bytes: {error:?}",
            answer.error_bytes
        );
    }
    let answered = |want: Code, want_reason: Option<&str>| -> Result<(), String> {
        ensure!(
            (code, reason) == (want, want_reason),
            "expected {want:?}/{want_reason:?}, got {code:?}/{reason:?}: {}",
            error
                .status()
                .message()
                .chars()
                .take(300)
                .collect::<String>()
        );
        Ok(())
    };
    match expect {
        Refused(code, reason) => answered(*code, Some(reason))?,
        Invalid(field) => {
            answered(Code::InvalidArgument, Some("INVALID_REQUEST"))?;
            let fields = error.violated_fields();
            ensure!(
                fields.iter().any(|f| f == field),
                "{field} not among the violations {fields:?}"
            );
            // At most 16 violations, then one that counts the rest.
            ensure!(fields.len() <= 17, "{} violations", fields.len());
        }
        Read(mentions) => {
            answered(Code::Ok, None)?;
            if let Some(id) = mentions {
                ensure!(
                    answer.message.windows(id.len()).any(|w| w == id.as_bytes()),
                    "the answer does not name {id}"
                );
            }
        }
        Created => {
            answered(Code::Ok, None)?;
            let sent = pb::CreatePermitRequest::decode(row.body.as_slice())
                .expect("a CreatePermitRequest")
                .permit
                .expect("a permit");
            let got = pb::Permit::decode(answer.message.as_slice()).expect("a Permit");
            let fields = |p: &pb::Permit| {
                (
                    p.subject.clone(),
                    p.currency.clone(),
                    p.tools.clone(),
                    p.max_calls_per_tool.clone(),
                    p.budget,
                    p.expires_at,
                )
            };
            ensure!(
                fields(&got) == fields(&sent),
                "stored {:?}, sent {:?}",
                fields(&got),
                fields(&sent)
            );
            return Ok(Some(got.permit_id));
        }
        Transport => {
            answered(Code::ResourceExhausted, Some("MESSAGE_TOO_LARGE"))?;
            let metadata = error.metadata();
            let size = row.body.len().to_string();
            let limit = MAX_DECODE_BYTES.to_string();
            ensure!(
                metadata.get("limit") == Some(&limit) && metadata.get("size") == Some(&size),
                "metadata {metadata:?}, expected limit {limit}, size {size}"
            );
        }
        Undecodable => answered(Code::Internal, None)?,
        Unhandled(code) => answered(*code, None)?,
    }
    Ok(None)
}

/// What differs between two snapshots: the first differing item of each
/// part, briefly.
fn diff(was: &Snapshot, is: &Snapshot) -> String {
    fn first<T: std::fmt::Debug + PartialEq>(name: &str, a: &[T], b: &[T]) -> Option<String> {
        let short = |x: Option<&T>| format!("{x:?}").chars().take(600).collect::<String>();
        (0..a.len().max(b.len()))
            .find(|&i| a.get(i) != b.get(i))
            .map(|i| format!("{name}[{i}]: {} -> {}", short(a.get(i)), short(b.get(i))))
    }
    let mut out = vec![
        first("permits", &was.permits, &is.permits),
        first("uncertain", &was.uncertain, &is.uncertain),
        first("pages", &was.pages, &is.pages),
        first("rereads", &was.rereads, &is.rereads),
    ];
    if let (Some(a), Some(b)) = (&was.redis, &is.redis) {
        let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
        for key in keys {
            out.push(first(key, &[a.get(key)], &[b.get(key)]));
        }
    }
    out.into_iter().flatten().collect::<Vec<_>>().join("; ")
}

// === the store before and after ===

/// What the campaign set up, through the API.
struct Fixture {
    /// Tools "search" and "send_email" (capped at 5), a budget of 1,000,000,
    /// and one attempt in each state but RELEASED.
    p: String,
    /// Tool "t", no budget, two UNCERTAIN attempts.
    q: String,
    /// Revoked; its subject and currency are control characters.
    r: String,
    succeeded: pb::Attempt,
    /// Its failure reason is control characters.
    failed: pb::Attempt,
    /// Held by a holder token, its lease far from over.
    reserved: pb::Attempt,
    /// Marked with a reason of control characters.
    uncertain: pb::Attempt,
    /// A page token inside P's listing, and one inside Q's.
    p_token: String,
    q_token: String,
    /// Authorize requests that read known keys back, changing nothing: the
    /// replays of the SUCCEEDED and FAILED keys, the redelivery of the
    /// RESERVED one to its holder.
    rereads: Vec<pb::AuthorizeRequest>,
    redis: Option<redis::aio::MultiplexedConnection>,
}

async fn set_up(h: &Harness) -> Fixture {
    let mut spec = h.permit(&["search", "send_email"]);
    spec.max_calls_per_tool.insert("send_email".into(), 5);
    spec.budget = Some(1_000_000);
    spec.lease = duration(600, 0);
    let p = h.create(spec).await.permit_id;
    let request = |permit_id: &str, tool: &str, key: &str, cost: i64| pb::AuthorizeRequest {
        permit_id: permit_id.to_owned(),
        tool: tool.into(),
        idempotency_key: key.into(),
        request_fingerprint: format!("fp-{key}").into_bytes(),
        cost,
        holder_token: Vec::new(),
        ..Default::default()
    };
    let dispatch = |r: pb::AuthorizeRequest| async move {
        let answer = h.client.authorize(r).await.expect("authorize");
        assert_eq!(answer.decision(), pb::Decision::Dispatch);
        answer.attempt.expect("attempt")
    };

    let rereads = vec![
        request(&p, "search", "k-succeeded", 10),
        request(&p, "search", "k-failed", 20),
        pb::AuthorizeRequest {
            holder_token: b"holder-1".to_vec(),
            ..request(&p, "search", "k-reserved", 30)
        },
    ];
    let attempt = dispatch(rereads[0].clone()).await;
    let succeeded = h
        .commit(&attempt, succeeded(b"result", None))
        .await
        .expect("commit")
        .attempt
        .expect("attempt");
    let attempt = dispatch(rereads[1].clone()).await;
    let failed_attempt = h
        .commit(&attempt, failed(CTRL))
        .await
        .expect("commit")
        .attempt
        .expect("attempt");
    assert_eq!(failed_attempt.failure_reason, CTRL);
    let reserved = dispatch(rereads[2].clone()).await;
    let mut uncertain = Vec::new();
    for (key, reason) in [("k-uncertain", CTRL), ("k-uncertain-2", "")] {
        let attempt = dispatch(request(&p, "send_email", key, 40)).await;
        uncertain.push(
            h.mark_uncertain(&attempt, reason)
                .await
                .expect("mark")
                .attempt
                .expect("attempt"),
        );
    }
    assert_eq!(uncertain[0].uncertain_reason, CTRL);
    let p_token = h.list(&p, 1, "").await.expect("list").next_page_token;
    assert!(!p_token.is_empty());

    let q = h.create(h.permit(&["t"])).await.permit_id;
    for key in ["q-1", "q-2"] {
        let attempt = dispatch(request(&q, "t", key, 5)).await;
        h.mark_uncertain(&attempt, "").await.expect("mark");
    }
    let q_token = h.list(&q, 1, "").await.expect("list").next_page_token;
    assert!(!q_token.is_empty());

    let mut spec = h.permit(&["t"]);
    spec.subject = CTRL.into();
    spec.currency = CTRL.into();
    let r = h.create(spec).await.permit_id;
    h.client.revoke_permit(&r).await.expect("revoke");
    let got = h.get(&r).await.expect("get").permit.expect("permit");
    assert_eq!((got.subject.as_str(), got.currency.as_str()), (CTRL, CTRL));

    let redis = match &h.redis {
        Some(redis) => Some(redis.connect().await),
        None => None,
    };
    Fixture {
        p,
        q,
        r,
        succeeded,
        failed: failed_attempt,
        reserved,
        uncertain: uncertain.swap_remove(0),
        p_token,
        q_token,
        rereads,
        redis,
    }
}

/// The store as the API (and, on Redis, Redis itself) reads it back.
#[derive(Debug, Clone, PartialEq)]
struct Snapshot {
    permits: Vec<pb::GetPermitResponse>,
    /// Every UNCERTAIN attempt, across permits.
    uncertain: Vec<pb::Attempt>,
    /// The first page of size 1 of P's, Q's and the cross-permit listing,
    /// with their page tokens.
    pages: Vec<pb::ListUncertainResponse>,
    rereads: Vec<pb::AuthorizeResponse>,
    /// The known attempts as GetAttempt reads them.
    attempts: Vec<pb::GetAttemptResponse>,
    /// Every key under the test's prefix.
    redis: Option<BTreeMap<String, Stored>>,
}

/// One Redis key: its type, its expiry, and its content as (field, value)
/// pairs (hash: field and value; sorted set: member and score; set:
/// member; string: its value; list: index and item), escaped.
#[derive(Debug, PartialEq, Clone)]
struct Stored {
    kind: String,
    expires_at: i64,
    items: BTreeSet<(String, String)>,
}

impl Snapshot {
    /// Without what mentions `id`: the keys of that permit, and its entries
    /// in shared keys.
    fn without(&self, id: &str) -> Self {
        let mut out = self.clone();
        if let Some(keys) = &mut out.redis {
            keys.retain(|k, _| !k.contains(id));
            for stored in keys.values_mut() {
                stored
                    .items
                    .retain(|(a, b)| !a.contains(id) && !b.contains(id));
            }
        }
        out
    }
}

async fn snapshot(h: &Harness, f: &Fixture) -> Snapshot {
    let mut permits = Vec::new();
    for id in [&f.p, &f.q, &f.r] {
        permits.push(h.get(id).await.expect("get"));
    }
    let mut pages = Vec::new();
    for id in [f.p.as_str(), f.q.as_str(), ""] {
        pages.push(h.list(id, 1, "").await.expect("list"));
    }
    let mut rereads = Vec::new();
    for r in &f.rereads {
        rereads.push(h.client.authorize(r.clone()).await.expect("reread"));
    }
    let mut attempts = Vec::new();
    for a in [&f.succeeded, &f.failed, &f.reserved, &f.uncertain] {
        attempts.push(
            h.client
                .get_attempt(&a.permit_id, &a.idempotency_key)
                .await
                .expect("get attempt"),
        );
    }
    let redis = match (&h.redis, &f.redis) {
        (Some(redis), Some(conn)) => Some(dump(&redis.prefix, &mut conn.clone()).await),
        _ => None,
    };
    Snapshot {
        permits,
        uncertain: h.list_all("", 1000).await,
        pages,
        rereads,
        attempts,
        redis,
    }
}

/// Every key under `prefix`, read in three round trips: the names, their
/// types, then their contents and expiries.
async fn dump(
    prefix: &str,
    conn: &mut redis::aio::MultiplexedConnection,
) -> BTreeMap<String, Stored> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}:*"))
        .query_async(conn)
        .await
        .expect("KEYS");
    let mut types = redis::pipe();
    for key in &keys {
        types.cmd("TYPE").arg(key);
    }
    let kinds: Vec<String> = types.query_async(conn).await.expect("TYPE");
    let mut contents = redis::pipe();
    for (key, kind) in keys.iter().zip(&kinds) {
        match kind.as_str() {
            "hash" => contents.cmd("HGETALL").arg(key),
            "zset" => contents
                .cmd("ZRANGE")
                .arg(key)
                .arg(0)
                .arg(-1)
                .arg("WITHSCORES"),
            "set" => contents.cmd("SMEMBERS").arg(key),
            "list" => contents.cmd("LRANGE").arg(key).arg(0).arg(-1),
            "string" => contents.cmd("GET").arg(key),
            other => panic!("{key}: a {other} key"),
        };
        contents.cmd("PEXPIRETIME").arg(key);
    }
    let values: Vec<redis::Value> = contents.query_async(conn).await.expect("read");
    let text = |b: &[u8]| b.escape_ascii().to_string();
    let mut out = BTreeMap::new();
    for ((key, kind), read) in keys.into_iter().zip(kinds).zip(values.chunks(2)) {
        let items = match kind.as_str() {
            "string" => {
                let value: Vec<u8> = redis::from_redis_value_ref(&read[0]).expect("a string");
                [(String::new(), text(&value))].into()
            }
            _ => {
                let flat: Vec<Vec<u8>> = redis::from_redis_value_ref(&read[0]).expect("items");
                match kind.as_str() {
                    "hash" | "zset" => flat.chunks(2).map(|c| (text(&c[0]), text(&c[1]))).collect(),
                    "set" => flat.iter().map(|m| (text(m), String::new())).collect(),
                    _ => flat
                        .iter()
                        .enumerate()
                        .map(|(i, item)| (format!("{i:06}"), text(item)))
                        .collect(),
                }
            }
        };
        let expires_at = redis::from_redis_value_ref(&read[1]).expect("PEXPIRETIME");
        out.insert(
            key,
            Stored {
                kind,
                expires_at,
                items,
            },
        );
    }
    out
}
