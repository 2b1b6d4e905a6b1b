//! Property-based fuzzing of the Redis reply decoder: a script's msgpack
//! reply, as Redis (or anything that answers in its place) may send it,
//! through [`unpack_reply`] and each operation's decoding of it
//! (`redis.rs`). The properties:
//!
//! - nothing panics, however deep, long, truncated or mistyped the reply;
//! - a reply atmost cannot read is STORE_UNAVAILABLE (never a guess);
//! - whatever the reply says, the error the client gets is small
//!   ([`small_status`]), with a reason of the contract;
//! - what decodes is encoded for the client without a panic.
//!
//! Runs with the API's fuzzing (`cargo test -p atmost --lib fuzz`).

use super::codec::{decode_permit, encode_permit};
use super::reply::{About, decode_attempt, decode_usage, malformed, open, open_ok};
use super::unpack_reply;
use crate::api::convert;
use crate::api::fuzz::{Edit, config, edit, edits, re, small_status};
use crate::domain::{
    ApprovalRule, Attempt, DuplicateGuard, Error, GuardMode, Permit, PermitStatus, PermitView,
    Reason, UncertainPolicy, Usage,
};
use proptest::prelude::*;
use proptest::sample::{Index, select};
use proptest::test_runner::TestCaseError;
use prost::Message;
use redis::Value;

/// Cases per property in `cargo test`.
const CASES: u32 = 256;

/// MAX_DEPTH in reply.rs: the deepest nesting of arrays a reply may have.
const MAX_DEPTH: usize = 8;

const PERMIT_ID: &str = "0190a6e0-0000-7000-8000-000000000001";

/// What an Authorize asked: every value a reason may need, as validation
/// lets them through.
fn about() -> About<'static> {
    About {
        tool: Some("payments.charge"),
        cost: Some(25),
        ..About::key(PERMIT_ID, "order-42 (retry)")
    }
}

// === each operation's decoding, as redis.rs does it ===

fn authorize(values: Vec<Value>) -> Result<(Attempt, Usage, String), Error> {
    let (verdict, mut f) = open(values, &about())?;
    if !matches!(
        verdict.as_str(),
        "DISPATCH" | "REDELIVERED" | "REPLAY" | "AWAIT_APPROVAL"
    ) {
        return Err(malformed(format!("verdict {verdict:?}")));
    }
    let attempt = decode_attempt(PERMIT_ID, f.array()?)?;
    let usage = decode_usage(f.array()?)?;
    let duplicate_of = f.string()?;
    f.int()?;
    Ok((attempt, usage, duplicate_of))
}

/// Commit and Resolve (settle.lua).
fn settle(values: Vec<Value>) -> Result<(Attempt, Usage), Error> {
    let mut f = open_ok(values, &About::key(PERMIT_ID, "k"))?;
    Ok((
        decode_attempt(PERMIT_ID, f.array()?)?,
        decode_usage(f.array()?)?,
    ))
}

fn mark_uncertain(values: Vec<Value>) -> Result<Attempt, Error> {
    let mut f = open_ok(values, &About::key(PERMIT_ID, "k"))?;
    decode_attempt(PERMIT_ID, f.array()?)
}

/// GetPermit and RevokePermit.
fn get_permit(values: Vec<Value>) -> Result<PermitView, Error> {
    let mut f = open_ok(values, &About::permit(PERMIT_ID))?;
    decode_permit(PERMIT_ID, f.array()?)
}

/// Approve (approve.lua).
fn approve(values: Vec<Value>) -> Result<Attempt, Error> {
    let mut f = open_ok(values, &About::key(PERMIT_ID, "k"))?;
    decode_attempt(PERMIT_ID, f.array()?)
}

/// One run of list_uncertain.lua, or of list_approvals.lua (its count of
/// members read and its last member, then the attempts).
fn list_one(values: Vec<Value>) -> Result<(i64, bool, Vec<Attempt>), Error> {
    let mut f = open_ok(values, &About::permit(PERMIT_ID))?;
    let expires_at = f.int()?;
    let removable = f.flag()?;
    let mut attempts = Vec::new();
    while !f.done() {
        attempts.push(decode_attempt(PERMIT_ID, f.array()?)?);
    }
    Ok((expires_at, removable, attempts))
}

/// An error from decoding alone (no script's verdict in it): only ever
/// STORE_UNAVAILABLE.
fn unreadable(error: Error) -> Result<(), TestCaseError> {
    prop_assert_eq!(error.reason(), Reason::StoreUnavailable, "{:?}", error);
    small_status(error).map(drop)
}

/// What the client gets of one operation's answer: a small error, or the
/// decoded values encoded for the wire.
fn answered<T>(result: Result<T, Error>, encode: impl FnOnce(T)) -> Result<(), TestCaseError> {
    match result {
        Ok(value) => {
            encode(value);
            Ok(())
        }
        Err(e) => small_status(e).map(drop),
    }
}

fn encode_attempt(a: Attempt) {
    let _ = convert::attempt(a, "", None).encode_to_vec();
}

fn encode_usage(u: Usage) {
    let _ = convert::usage(u).encode_to_vec();
}

/// `bytes` as the reply of every script in turn.
fn check_reply(bytes: &[u8]) -> Result<(), TestCaseError> {
    let values = match unpack_reply(bytes) {
        Ok(values) => values,
        Err(e) => return unreadable(e),
    };
    answered(authorize(values.clone()), |(a, u, _)| {
        encode_attempt(a);
        encode_usage(u);
    })?;
    answered(settle(values.clone()), |(a, u)| {
        encode_attempt(a);
        encode_usage(u);
    })?;
    answered(mark_uncertain(values.clone()), encode_attempt)?;
    answered(approve(values.clone()), encode_attempt)?;
    answered(get_permit(values.clone()), |view| {
        let _ = view.budget_remaining();
        view.usage.into_iter().for_each(encode_usage);
        let _ = convert::permit(view.permit).encode_to_vec();
    })?;
    answered(list_one(values.clone()), |(_, _, attempts)| {
        attempts.into_iter().for_each(encode_attempt);
    })?;
    // The record decoders on their own: nothing but STORE_UNAVAILABLE.
    for decoded in [
        decode_attempt(PERMIT_ID, values.clone()).map(drop),
        decode_usage(values.clone()).map(drop),
    ] {
        if let Err(e) = decoded {
            unreadable(e)?;
        }
    }
    match decode_permit(PERMIT_ID, values) {
        Err(Error::PermitNotFound { .. }) | Ok(_) => {}
        Err(e) => unreadable(e)?,
    }
    Ok(())
}

// === replies: plausible ones, hostile values in them, packed, altered ===

/// An integer: small, a time, or at the edges.
fn int() -> BoxedStrategy<i64> {
    prop_oneof![
        4 => 0..=5i64,
        2 => 1_767_225_600_000..=253_402_300_799_999i64,
        1 => Just(253_402_300_800_000i64),
        1 => Just(-1i64),
        1 => Just(i64::MIN),
        1 => Just(i64::MAX),
        1 => Just((1i64 << 53) - 1),
        1 => any::<i64>(),
    ]
    .boxed()
}

/// Words a script answers with, and some it does not.
fn word() -> BoxedStrategy<String> {
    let mut words = vec![
        "OK",
        "ERR",
        "DISPATCH",
        "REDELIVERED",
        "REPLAY",
        "",
        "0",
        "1",
        "-1",
        "9223372036854775807",
        "9223372036854775808",
        "-9223372036854775809",
        "253402300800000",
        "1e3",
        " 7",
        "KEY_REUSED",
        "é",
    ];
    words.extend(Reason::ALL.iter().map(|r| r.as_str()));
    select(words).prop_map(str::to_owned).boxed()
}

/// A string value: a word, bytes of any kind (16 of them make an id), or
/// a long one.
fn bulk() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => word().prop_map(|w| Value::BulkString(w.into_bytes())),
        1 => int().prop_map(|n| Value::BulkString(n.to_string().into_bytes())),
        2 => proptest::collection::vec(any::<u8>(), 0..=20).prop_map(Value::BulkString),
        1 => (any::<u8>(), 0usize..=200_000).prop_map(|(b, n)| Value::BulkString(vec![b; n])),
    ]
    .boxed()
}

/// Any value a reply may hold, nested a few deep.
fn value() -> BoxedStrategy<Value> {
    let leaf = prop_oneof![
        1 => Just(Value::Nil),
        3 => int().prop_map(Value::Int),
        4 => bulk(),
    ];
    leaf.prop_recursive(4, 64, 12, |inner| {
        proptest::collection::vec(inner, 0..12).prop_map(Value::Array)
    })
    .boxed()
}

/// `plausible`, with each element swapped for any value as `mask` says.
fn spoil(plausible: Vec<Value>, hostile: Vec<Value>, mask: u64) -> Vec<Value> {
    plausible
        .into_iter()
        .zip(hostile)
        .enumerate()
        .map(|(i, (p, h))| if mask >> (i % 64) & 1 == 1 { h } else { p })
        .collect()
}

/// Which elements get a hostile value: none, one, or many.
fn mask() -> BoxedStrategy<u64> {
    prop_oneof![
        8 => Just(0u64),
        4 => (0u32..24).prop_map(|i| 1u64 << i),
        1 => (any::<u64>(), any::<u64>()).prop_map(|(a, b)| a & b),
    ]
    .boxed()
}

fn id_bytes() -> BoxedStrategy<Value> {
    prop_oneof![
        4 => any::<[u8; 16]>().prop_map(|b| Value::BulkString(b.to_vec())),
        1 => Just(Value::BulkString(Vec::new())),
    ]
    .boxed()
}

fn text_value() -> BoxedStrategy<Value> {
    re("[ -~]{0,16}")
        .prop_map(|s| Value::BulkString(s.into_bytes()))
        .boxed()
}

/// lib.lua's attempt_reply, its fields now and then of any kind.
fn attempt_reply() -> BoxedStrategy<Value> {
    let plausible = (
        (
            id_bytes(),
            text_value(),
            text_value(),
            int().prop_map(Value::Int),
        ),
        (1..=5i64, int(), int())
            .prop_map(|(s, c, l)| vec![Value::Int(s), Value::Int(c), Value::Int(l)]),
        (
            id_bytes(),
            text_value(),
            int().prop_map(Value::Int),
            int().prop_map(Value::Int),
        ),
        (
            text_value(),
            text_value(),
            text_value(),
            int().prop_map(Value::Int),
            text_value(),
        ),
    )
        .prop_map(|((a, b, c, d), e, (f, g, h, i), (j, k, l, m, n))| {
            let mut v = vec![a, b, c, d];
            v.extend(e);
            v.extend([f, g, h, i, j, k, l, m, n]);
            v
        })
        .boxed();
    (
        plausible,
        prop_oneof![3 => Just(None), 1 => approval_reply().prop_map(Some)],
        proptest::collection::vec(value(), 17),
        mask(),
        0usize..=19,
    )
        .prop_map(|(mut p, approval, h, mask, len)| {
            p.extend(approval);
            let mut fields = spoil(p, h, mask);
            // Cut short or made longer, now and then.
            if mask & (1 << 40) != 0 {
                fields.resize(len, Value::Nil);
            }
            Value::Array(fields)
        })
        .boxed()
}

/// The approval of lib.lua's attempt_reply, its fields now and then of
/// any kind.
fn approval_reply() -> BoxedStrategy<Value> {
    let plausible = (
        text_value(),
        int(),
        prop_oneof![4 => 1..=2i64, 1 => int()],
        proptest::collection::vec(text_value(), 0..=2),
        text_value(),
        int(),
        text_value(),
    )
        .prop_map(|(summary, expires, needed, by, decided_by, at, reason)| {
            vec![
                summary,
                Value::Int(expires),
                Value::Int(needed),
                Value::Array(by),
                decided_by,
                Value::Int(at),
                reason,
            ]
        });
    (plausible, proptest::collection::vec(value(), 7), mask())
        .prop_map(|(p, h, mask)| Value::Array(spoil(p, h, mask >> 3)))
        .boxed()
}

/// lib.lua's usage_reply.
fn usage_reply() -> BoxedStrategy<Value> {
    let plausible = (text_value(), 0..=10i64, 0..=1i64, int(), 0..=1i64, int()).prop_map(
        |(tool, calls, has_limit, limit, has_budget, remaining)| {
            vec![
                tool,
                Value::Int(calls),
                Value::Int(has_limit),
                Value::Int(limit),
                Value::Int(has_budget),
                Value::Int(remaining),
            ]
        },
    );
    (plausible, proptest::collection::vec(value(), 6), mask())
        .prop_map(|(p, h, mask)| Value::Array(spoil(p, h, mask)))
        .boxed()
}

/// A permit hash as HGETALL answers it: one atmost wrote, with a field
/// changed, dropped or added now and then.
fn permit_hash() -> BoxedStrategy<Value> {
    let rule = (
        proptest::option::of(0..=1000i64),
        1..=604_800_000i64,
        1..=2u32,
    )
        .prop_map(|(cost_at_least, wait_ms, approvers)| ApprovalRule {
            cost_at_least,
            wait_ms,
            approvers,
        });
    let permit = (
        proptest::collection::vec(re("[a-z]{1,6}"), 1..=3),
        proptest::option::of(0..=1000i64),
        proptest::option::of(rule),
    )
        .prop_map(|(mut tools, budget, rule)| {
            tools.sort();
            tools.dedup();
            Permit {
                approval_per_tool: rule
                    .map(|r| [(tools[0].clone(), r)].into())
                    .unwrap_or_default(),
                permit_id: PERMIT_ID.into(),
                subject: "agent-7".into(),
                max_calls_per_tool: [(tools[0].clone(), 3)].into(),
                tools,
                budget,
                currency: "EUR".into(),
                expires_at: 1_767_225_600_000,
                lease_ms: 30_000,
                duplicate_guard: DuplicateGuard {
                    mode: GuardMode::Enforce,
                    window_ms: 600_000,
                },
                uncertain_policy: UncertainPolicy::HoldTool,
                status: PermitStatus::Active,
                created_at: 1_767_222_000_000,
                tenant: "acme".into(),
                agents: vec!["agent-1".into()],
            }
        });
    // Mostly a number field set to any integer (amounts, times, codes),
    // or any field changed, dropped or added.
    let numbers = vec![
        "exp",
        "lease",
        "gmode",
        "gwin",
        "status",
        "created",
        "committed",
        "reserved",
        "budget",
        "upol",
        "appr",
    ];
    let change = prop_oneof![
        4 => (select(numbers), int())
            .prop_map(|(name, n)| Change::Set(name.into(), n.to_string().into_bytes())),
        1 => (any::<Index>(), bulk()).prop_map(|(at, v)| Change::Replace(at, v)),
        1 => any::<Index>().prop_map(Change::Drop),
        1 => (word(), bulk()).prop_map(|(name, v)| Change::Add(name, v)),
        1 => int().prop_map(Change::Calls),
        1 => prop_oneof![
            select(vec![":1000:1", "5:1:2", ":0:1", "1:1:3", "x:1:1", "01:5:1", ":604800001:1", ""])
                .prop_map(|v| v.as_bytes().to_vec()),
            bulk().prop_map(|v| match v {
                Value::BulkString(b) => b,
                _ => Vec::new(),
            }),
        ]
        .prop_map(Change::Rule),
    ];
    (permit, proptest::collection::vec(change, 0..4))
        .prop_map(|(permit, changes)| {
            let mut fields: Vec<(String, Value)> = encode_permit(&permit)
                .into_iter()
                .map(|(k, v)| (k, Value::BulkString(v)))
                .collect();
            for change in changes {
                match change {
                    Change::Set(name, v) => match fields.iter_mut().find(|(k, _)| *k == name) {
                        Some(field) => field.1 = Value::BulkString(v),
                        None => fields.push((name, Value::BulkString(v))),
                    },
                    Change::Replace(at, v) if !fields.is_empty() => {
                        let i = at.index(fields.len());
                        fields[i].1 = v;
                    }
                    Change::Drop(at) if !fields.is_empty() => {
                        fields.remove(at.index(fields.len()));
                    }
                    Change::Add(name, v) => fields.push((name, v)),
                    Change::Calls(n) => fields.push((
                        format!("n:{}", permit.tools[0]),
                        Value::BulkString(n.to_string().into_bytes()),
                    )),
                    Change::Rule(v) => {
                        fields.push((format!("ap:{}", permit.tools[0]), Value::BulkString(v)))
                    }
                    _ => {}
                }
            }
            Value::Array(
                fields
                    .into_iter()
                    .flat_map(|(k, v)| [Value::BulkString(k.into_bytes()), v])
                    .collect(),
            )
        })
        .boxed()
}

/// One change to a stored permit hash.
#[derive(Debug, Clone)]
enum Change {
    Set(String, Vec<u8>),
    Replace(Index, Value),
    Drop(Index),
    Add(String, Value),
    /// A tool's call count.
    Calls(i64),
    /// A tool's approval rule.
    Rule(Vec<u8>),
}

/// A whole reply, shaped as one of the scripts' (a verdict and what
/// follows it, or an error reason and its fields), or anything.
fn reply() -> BoxedStrategy<Value> {
    let s = |w: &str| Value::BulkString(w.as_bytes().to_vec());
    let verdict = prop_oneof![
        4 => select(vec!["OK", "DISPATCH", "REDELIVERED", "REPLAY"]).prop_map(s),
        1 => Just(s("AWAIT_APPROVAL")),
        1 => bulk(),
    ];
    let error = (
        select(Reason::ALL.to_vec()).prop_map(|r| r.as_str()),
        proptest::collection::vec(
            prop_oneof![
                4 => int().prop_map(|n| Value::BulkString(n.to_string().into_bytes())),
                2 => bulk(),
                1 => value(),
            ],
            0..=4,
        ),
    );
    let verdict_reply = (
        verdict,
        attempt_reply(),
        usage_reply(),
        prop_oneof![4 => text_value(), 1 => value()],
        prop_oneof![4 => int().prop_map(Value::Int), 1 => value()],
    )
        .prop_map(|(v, a, u, d, l)| Value::Array(vec![v, a, u, d, l]))
        .boxed();
    prop_oneof![
        10 => verdict_reply,
        3 => error
            .prop_map(move |(reason, fields)| {
                let mut reply = vec![s("ERR"), s(reason)];
                reply.extend(fields);
                Value::Array(reply)
            })
            .boxed(),
        1 => (bulk(), proptest::collection::vec(value(), 0..4))
            .prop_map(move |(name, fields)| {
                let mut reply = vec![s("ERR"), name];
                reply.extend(fields);
                Value::Array(reply)
            })
            .boxed(),
        3 => permit_hash()
            .prop_map(move |hash| Value::Array(vec![s("OK"), hash]))
            .boxed(),
        2 => (int(), 0..=1i64, proptest::collection::vec(attempt_reply(), 0..4))
            .prop_map(move |(at, flag, attempts)| {
                let mut reply = vec![s("OK"), Value::Int(at), Value::Int(flag)];
                reply.extend(attempts);
                Value::Array(reply)
            })
            .boxed(),
        1 => value(),
    ]
    .boxed()
}

/// Packs `value` as msgpack, each string as str or bin and each integer in
/// its shortest form or as 8 bytes, as `style` says; and, at `style`'s
/// whim, a type no script returns (a float, a map, a bool).
fn pack(value: &Value, style: &mut impl Iterator<Item = u8>, out: &mut Vec<u8>) {
    use rmp::encode;
    let how = style.next().unwrap_or(0);
    match value {
        Value::Nil => encode::write_nil(out).expect("a Vec"),
        Value::Int(n) => match how {
            0..=31 => encode::write_i64(out, *n).expect("a Vec"),
            32..=63 if *n >= 0 => encode::write_u64(out, *n as u64).expect("a Vec"),
            255 => encode::write_f64(out, *n as f64).expect("a Vec"),
            _ => {
                encode::write_sint(out, *n).expect("a Vec");
            }
        },
        Value::BulkString(b) => {
            match how {
                0..=63 => encode::write_bin_len(out, b.len() as u32).expect("a Vec"),
                255 => return encode::write_bool(out, b.is_empty()).expect("a Vec"),
                _ => encode::write_str_len(out, b.len() as u32).expect("a Vec"),
            };
            out.extend_from_slice(b);
        }
        Value::Array(items) => {
            if how == 255 {
                encode::write_map_len(out, items.len() as u32).expect("a Vec");
            } else {
                encode::write_array_len(out, items.len() as u32).expect("a Vec");
            }
            for item in items {
                pack(item, style, out);
            }
        }
        _ => unreachable!("replies hold nil, integers, strings and arrays"),
    }
}

/// A reply's bytes: packed, packed and altered, nested past the limit, or
/// anything at all.
fn reply_bytes() -> BoxedStrategy<Vec<u8>> {
    let packed = (reply(), proptest::collection::vec(any::<u8>(), 0..64))
        .prop_map(|(value, style)| {
            let mut style = style.into_iter().cycle().chain(std::iter::repeat(128));
            let mut out = Vec::new();
            pack(&value, &mut style, &mut out);
            out
        })
        .boxed();
    prop_oneof![
        8 => packed.clone(),
        4 => (packed, edits())
            .prop_map(|(bytes, e): (Vec<u8>, Vec<Edit>)| edit(bytes, &e))
            .boxed(),
        1 => (0usize..100_000, any::<u8>()).prop_map(|(depth, leaf)| {
            let mut bytes = vec![0x91; depth];
            bytes.push(leaf);
            bytes
        }),
        2 => proptest::collection::vec(any::<u8>(), 0..512),
    ]
    .boxed()
}

// === the properties ===

proptest! {
    #![proptest_config(config(CASES))]

    /// Whatever Redis (or something in its place) answers, every script's
    /// decoding answers a value or a small error, never a panic.
    #[test]
    fn any_reply_is_decoded_or_refused_small(bytes in reply_bytes()) {
        check_reply(&bytes)?;
    }

    /// `depth` arrays one inside the other: read up to atmost's limit,
    /// STORE_UNAVAILABLE past it, never a stack overflow.
    #[test]
    fn a_reply_nested_past_the_limit_is_unavailable(
        depth in prop_oneof![0usize..=2 * MAX_DEPTH, 0usize..100_000],
        leaf in 0u8..0x80,
    ) {
        let mut bytes = vec![0x91; depth];
        bytes.push(leaf);
        match unpack_reply(&bytes) {
            Ok(_) => prop_assert!((1..=MAX_DEPTH).contains(&depth), "{depth} deep"),
            Err(e) => {
                prop_assert!(depth == 0 || depth > MAX_DEPTH, "{depth} deep: {e:?}");
                unreadable(e)?;
            }
        }
    }
}

/// The strategies reach the decoders' far ends: replies whose every
/// operation decodes, and replies each decoder refuses.
#[test]
fn the_replies_reach_every_decoder() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let mut seen = [[0usize; 2]; 5];
    // Attempts decoded with an approval, permits with an approval rule.
    let (mut approvals, mut rules) = (0, 0);
    for _ in 0..300 {
        let bytes = reply_bytes()
            .new_tree(&mut runner)
            .expect("a reply")
            .current();
        check_reply(&bytes).expect("the property holds");
        let Ok(values) = unpack_reply(&bytes) else {
            continue;
        };
        for attempt in [
            authorize(values.clone()).map(|(a, _, _)| a),
            settle(values.clone()).map(|(a, _)| a),
            mark_uncertain(values.clone()),
        ]
        .into_iter()
        .flatten()
        .chain(list_one(values.clone()).map_or(Vec::new(), |(_, _, list)| list))
        {
            approvals += usize::from(attempt.approval.is_some());
        }
        if let Ok(view) = get_permit(values.clone()) {
            rules += usize::from(!view.permit.approval_per_tool.is_empty());
        }
        for (i, ok) in [
            authorize(values.clone()).is_ok(),
            settle(values.clone()).is_ok(),
            mark_uncertain(values.clone()).is_ok(),
            get_permit(values.clone()).is_ok(),
            list_one(values).is_ok(),
        ]
        .into_iter()
        .enumerate()
        {
            seen[i][usize::from(ok)] += 1;
        }
    }
    for (op, [refused, decoded]) in ["Authorize", "Settle", "MarkUncertain", "GetPermit", "List"]
        .iter()
        .zip(seen)
    {
        assert!(decoded >= 5, "{op}: {decoded} decoded");
        assert!(refused >= 5, "{op}: {refused} refused");
    }
    assert!(
        approvals >= 3,
        "{approvals} attempts with an approval decoded"
    );
    assert!(rules >= 3, "{rules} permits with an approval rule decoded");
}
