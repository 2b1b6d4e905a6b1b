//! The Rust runner of the cross-client test (scripts/cross_client.sh):
//! each situation of clients/testdata/guarded_situations.json through
//! `Client::guarded`, this crate's public API only, one JSON line per
//! situation on stdout: what each call returned or raised, how many times
//! it ran dispatch. The harness (examples/cross_client.rs of the server)
//! compares the lines with the file's expectations and with the Python and
//! Node runners'.
//!
//! ```text
//! situations <guarded_situations.json> <facts.json>
//! ```
//!
//! `facts.json`: `address`, `api_key`, `wrong_api_key`,
//! `unreachable_address`, and `permits` (situation name -> the permit id
//! the harness made for this language).

use atmost_client::{
    Client, DispatchError, Dispatched, GuardError, GuardedCall, Outcome, Unrecorded,
};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

const LANGUAGE: &str = "rust";

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [situations, facts] = args.as_slice() else {
        eprintln!("usage: situations <guarded_situations.json> <facts.json>");
        std::process::exit(2);
    };
    let situations = read_json(situations);
    let facts = read_json(facts);
    let tool = situations["tool"].as_str().expect("the file's tool");
    for situation in situations["situations"].as_array().expect("situations") {
        let name = situation["name"].as_str().expect("a situation's name");
        if let Some(languages) = situation["languages"].as_array()
            && !languages.iter().any(|l| l == LANGUAGE)
        {
            continue;
        }
        let permit_id = facts["permits"][name]
            .as_str()
            .unwrap_or_else(|| panic!("facts name no permit for {name}"));
        let mut calls: Vec<Value> = Vec::new();
        for call in situation["calls"].as_array().expect("calls") {
            // The calls after one this language cannot make depend on it.
            let seen = if calls.last().is_some_and(|c| c["kind"] == "unsupported") {
                json!({"kind": "unsupported", "message": "an earlier call was not made", "dispatched": 0})
            } else {
                run_call(&facts, tool, permit_id, call).await
            };
            calls.push(seen);
        }
        let line = json!({"situation": name, "language": LANGUAGE, "calls": calls});
        println!("{line}");
    }
}

fn read_json(path: &str) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("read {path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {path}: {e}"))
}

/// One guarded call as the situation describes it, and what came of it.
async fn run_call(facts: &Value, tool: &str, permit_id: &str, call: &Value) -> Value {
    let address = match call["server"].as_str() {
        Some("unreachable") => &facts["unreachable_address"],
        _ => &facts["address"],
    };
    let api_key = match call["api_key"].as_str() {
        Some("wrong") => &facts["wrong_api_key"],
        _ => &facts["api_key"],
    };
    let client = Client::builder(address.as_str().expect("an address"))
        .api_key(api_key.as_str().expect("an API key"))
        .connect_lazy()
        .expect("a client");
    let request: Value = serde_json::from_str(call["request"].as_str().expect("request text"))
        .expect("the request is JSON");
    let guarded = GuardedCall::new(
        permit_id,
        call["tool"].as_str().unwrap_or(tool),
        call["key"].as_str().expect("a key"),
    )
    .request(&native(&request))
    .cost(call["cost"].as_i64().unwrap_or(0));

    let dispatched = Arc::new(Mutex::new(0u32));
    // The bytes dispatch returned, to tell the Outcome's result is them.
    let returned: Arc<Mutex<Option<Vec<u8>>>> = Arc::default();
    let spec = call["dispatch"].clone();
    let actual_cost = &spec["actual_cost"];
    if !actual_cost.is_null() && actual_cost.as_i64().is_none() {
        // Dispatched::actual_cost takes an i64: no other cost can be given.
        let why = format!("an actual cost of {actual_cost} is no i64");
        return json!({"kind": "unsupported", "message": why, "dispatched": 0});
    }
    let answer = {
        let (dispatched, returned) = (dispatched.clone(), returned.clone());
        client
            .guarded(guarded, move |_attempt_id| async move {
                *dispatched.lock().expect("count") += 1;
                dispatch(&spec, &returned).await
            })
            .await
    };
    let dispatched = *dispatched.lock().expect("count");
    let returned = returned.lock().expect("returned").clone();
    match answer {
        Ok(outcome) => observed_outcome(&outcome, dispatched, returned.as_deref()),
        Err(error) => observed_error(&error, dispatched, returned.as_deref()),
    }
}

/// What the situation's dispatch does.
async fn dispatch(
    spec: &Value,
    returned: &Mutex<Option<Vec<u8>>>,
) -> Result<Dispatched, DispatchError> {
    if spec.is_null() {
        return Ok(Dispatched::json(&json!({"sent": "by mistake"})));
    }
    if let Some(reason) = spec["refuse"].as_str() {
        return Err(DispatchError::failed(reason));
    }
    if spec["not_sent"] == true {
        return Err(DispatchError::NotSent);
    }
    if let Some(text) = spec["error"].as_str() {
        return Err(
            std::io::Error::new(std::io::ErrorKind::ConnectionReset, text.to_owned()).into(),
        );
    }
    if spec["hang"] == true {
        std::future::pending::<()>().await;
    }
    // A native value (a NaN stays an f64 NaN), written as serde_json writes
    // it: a non-finite number as null.
    let bytes = serde_json::to_vec(&native(&spec["return"])).expect("serde_json writes it");
    *returned.lock().expect("returned") = Some(bytes.clone());
    Ok(match spec["actual_cost"].as_i64() {
        Some(cost) => Dispatched::bytes(bytes).actual_cost(cost),
        None => Dispatched::bytes(bytes),
    })
}

fn observed_outcome(outcome: &Outcome, dispatched: u32, returned: Option<&[u8]>) -> Value {
    json!({
        "kind": "none",
        "reason": null,
        "replayed": outcome.replayed,
        "dispatched": dispatched,
        "result": as_json(&outcome.result),
        "as_dispatched": !outcome.replayed && returned == Some(outcome.result.as_slice()),
        "receipt_cost": outcome.receipt.cost,
    })
}

fn observed_error(error: &GuardError, dispatched: u32, returned: Option<&[u8]>) -> Value {
    let mut seen = json!({
        "kind": kind(error),
        "reason": error.error().and_then(|e| e.reason_name()),
        "replayed": false,
        "dispatched": dispatched,
        "message": error.to_string(),
    });
    match error {
        GuardError::ToolFailed {
            reason, replayed, ..
        } => {
            seen["failure_reason"] = json!(reason);
            seen["replayed"] = json!(replayed);
        }
        GuardError::OutcomeUncertain { replayed, .. } => seen["replayed"] = json!(replayed),
        GuardError::CommitNotRecorded { outcome, .. } => {
            let unrecorded = match outcome {
                Unrecorded::Succeeded { result } => {
                    seen["result"] = as_json(result);
                    seen["as_dispatched"] = json!(returned == Some(result.as_slice()));
                    "SUCCEEDED"
                }
                Unrecorded::Failed { .. } => "FAILED",
                Unrecorded::NotSent => "NOT_SENT",
                Unrecorded::Uncertain { .. } => "UNCERTAIN",
            };
            seen["unrecorded"] = json!(unrecorded);
        }
        _ => {}
    }
    seen
}

/// The kind's name the situations file uses.
fn kind(error: &GuardError) -> String {
    match error {
        GuardError::Denied(_) => "Denied",
        GuardError::InProgress(_) => "InProgress",
        GuardError::Unavailable(_) => "Unavailable",
        GuardError::InvalidRequest(_) => "InvalidRequest",
        GuardError::Rpc(_) => "Rpc",
        GuardError::ToolFailed { .. } => "ToolFailed",
        GuardError::OutcomeUncertain { .. } => "OutcomeUncertain",
        GuardError::NotSent { .. } => "NotSent",
        GuardError::NoTimeToDispatch { .. } => "NoTimeToDispatch",
        GuardError::HeldByEarlierRun { .. } => "HeldByEarlierRun",
        GuardError::CommitNotRecorded { .. } => "CommitNotRecorded",
        GuardError::InvalidCall(_) => "invalid-argument",
        other => return format!("other:{other:?}"),
    }
    .to_owned()
}

/// Stored or returned bytes as the JSON they hold (else the text).
fn as_json(bytes: &[u8]) -> Value {
    serde_json::from_slice(bytes)
        .unwrap_or_else(|_| json!({"$bytes": String::from_utf8_lossy(bytes)}))
}

/// A JSON value as a native Rust one that keeps what JSON cannot: every
/// number as parsed (a u64 exact), and "$NaN", "$Infinity", "$-Infinity"
/// as those f64s.
fn native(value: &Value) -> serde_value::Value {
    use serde_value::Value as V;
    match value {
        Value::Null => V::Unit,
        Value::Bool(b) => V::Bool(*b),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => V::U64(u),
            (None, Some(i)) => V::I64(i),
            _ => V::F64(n.as_f64().expect("a number")),
        },
        Value::String(s) => match s.as_str() {
            "$NaN" => V::F64(f64::NAN),
            "$Infinity" => V::F64(f64::INFINITY),
            "$-Infinity" => V::F64(f64::NEG_INFINITY),
            _ => V::String(s.clone()),
        },
        Value::Array(items) => V::Seq(items.iter().map(native).collect()),
        Value::Object(map) => V::Map(
            map.iter()
                .map(|(k, v)| (V::String(k.clone()), native(v)))
                .collect::<BTreeMap<_, _>>(),
        ),
    }
}
