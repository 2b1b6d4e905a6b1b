use super::*;
use rmcp::model::NumberOrString;

#[test]
fn a_derived_key_names_the_session_and_the_request_id() {
    let session = "0b1f6a52-7d8e-4c1a-9a55-3f2b8c1d2e4f";
    assert_eq!(
        derived_key(session, &NumberOrString::Number(7)),
        format!("mcp:{session}:7")
    );
    // A string id and a number id never share a key.
    assert_eq!(
        derived_key(session, &NumberOrString::String("7".into())),
        format!("mcp:{session}:\"7\"")
    );
}

#[test]
fn a_derived_key_atmost_would_refuse_is_sent_as_a_digest() {
    let long = "x".repeat(300);
    let odd = "sessión";
    for (session, id) in [
        (long.as_str(), NumberOrString::Number(1)),
        (odd, NumberOrString::Number(1)),
        ("s", NumberOrString::String("línea\n".into())),
    ] {
        let key = derived_key(session, &id);
        assert!(key.starts_with("mcp:sha256:"), "{key}");
        assert_eq!(key.len(), "mcp:sha256:".len() + 64);
        assert_eq!(
            key,
            derived_key(session, &id),
            "the same request, the same key"
        );
    }
    assert_ne!(
        derived_key(&long, &NumberOrString::Number(1)),
        derived_key(&long, &NumberOrString::Number(2))
    );
}

#[test]
fn the_forwarded_meta_keeps_the_agents_keys_but_not_the_protocols() {
    let mut map = serde_json::Map::new();
    map.insert(META_IDEMPOTENCY_KEY.into(), "k".into());
    map.insert("traceparent".into(), "00-abc-def-01".into());
    map.insert("progressToken".into(), 3.into());
    map.insert(
        "io.modelcontextprotocol/protocolVersion".into(),
        "2026-07-28".into(),
    );
    let kept = forwarded_meta(RequestMetaObject(MetaObject(map)));
    let mut keys: Vec<_> = kept.keys().cloned().collect();
    keys.sort();
    assert_eq!(
        keys,
        vec![META_IDEMPOTENCY_KEY.to_owned(), "traceparent".into()]
    );
}

fn text_of(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect()
}

#[test]
fn a_refusal_is_stored_so_its_replay_is_the_same_answer() {
    let result = CallToolResult::error(vec![ContentBlock::text("card declined")]);
    let stored = failure_record(&Fresh::Result(result.clone()));
    match stored_failure(&stored) {
        Fresh::Result(replayed) => assert_eq!(replayed, result),
        Fresh::Error(e) => panic!("a result came back as an error: {e:?}"),
    }
    let error = ErrorData::new(
        ErrorCode(-32602),
        "unknown tool",
        Some(json!({"tool": "x"})),
    );
    let stored = failure_record(&Fresh::Error(error.clone()));
    match stored_failure(&stored) {
        Fresh::Error(replayed) => assert_eq!(replayed, error),
        Fresh::Result(r) => panic!("an error came back as a result: {r:?}"),
    }
}

#[test]
fn a_long_refusal_is_shortened_to_what_atmost_stores_and_stays_json() {
    let long = "é".repeat(3000);
    let result = CallToolResult::error(vec![ContentBlock::text(&long)]);
    let stored = failure_record(&Fresh::Result(result));
    assert!(stored.len() <= MAX_REASON_BYTES, "{}", stored.len());
    match stored_failure(&stored) {
        Fresh::Result(replayed) => {
            assert_eq!(replayed.is_error, Some(true));
            let text = text_of(&replayed);
            assert!(text.ends_with('…') && long.starts_with(text.trim_end_matches('…')));
            assert!(text.len() > 900, "kept as much as fits: {}", text.len());
        }
        Fresh::Error(e) => panic!("{e:?}"),
    }
    // Quotes and control characters grow when escaped: still within bounds.
    let escaped = "\"\u{1}".repeat(2000);
    let stored = failure_record(&Fresh::Result(CallToolResult::error(vec![
        ContentBlock::text(&escaped),
    ])));
    assert!(stored.len() <= MAX_REASON_BYTES, "{}", stored.len());
    let error = ErrorData::new(
        ErrorCode(-32603),
        "x".repeat(5000),
        Some(json!("y".repeat(5000))),
    );
    let stored = failure_record(&Fresh::Error(error));
    assert!(stored.len() <= MAX_REASON_BYTES, "{}", stored.len());
    match stored_failure(&stored) {
        Fresh::Error(e) => {
            assert_eq!(e.code, ErrorCode(-32603));
            assert!(e.data.is_none() && e.message.ends_with('…'));
        }
        Fresh::Result(r) => panic!("{r:?}"),
    }
}

#[test]
fn a_reason_or_result_the_proxy_did_not_store_replays_as_text() {
    // An operator's Resolve --failed / --succeeded, or another client's.
    match stored_failure("wallet said no") {
        Fresh::Result(r) => {
            assert_eq!(r.is_error, Some(true));
            assert_eq!(text_of(&r), "wallet said no");
        }
        Fresh::Error(e) => panic!("{e:?}"),
    }
    let r = stored_success(b"wallet tx 981");
    assert_eq!(
        (r.is_error, text_of(&r).as_str()),
        (Some(false), "wallet tx 981")
    );
    let digest = format!("sha256:{}", "ab".repeat(32));
    let r = stored_success(digest.as_bytes());
    assert!(text_of(&r).contains("over 64 KiB") && text_of(&r).contains(&digest));
    let result = CallToolResult::success(vec![ContentBlock::text("ok")]);
    assert_eq!(
        stored_success(&serde_json::to_vec(&result).unwrap()),
        result
    );
}

/// A call that comes in once the proxy is stopping is refused before
/// anything is asked: neither atmost nor the upstream is there (nothing
/// listens on port 9), and the answer is the stopping refusal, not the
/// upstream's NOT_SENT a call let through would end with.
#[tokio::test]
async fn a_call_once_stopping_is_refused_before_atmost_or_the_upstream_is_asked() {
    // As main does: reqwest (the upstream's client) takes rustls's provider.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = Client::builder("http://127.0.0.1:9")
        .connect_lazy()
        .expect("a lazy client");
    let upstream = Upstream::new(crate::config::UpstreamSpec::Http {
        url: "http://127.0.0.1:9/mcp".into(),
        ca: None,
    })
    .expect("an upstream spec");
    let gate = Arc::new(Gate::new(
        client,
        PermitSource::Fixed("permit-1".into()),
        Costs::default(),
        None,
        Duration::ZERO,
        Arc::new(upstream),
        Some("session-1".into()),
    ));
    gate.stop();
    let origin = Origin {
        request_id: Some(NumberOrString::Number(4)),
        session: Some("session-1".into()),
        headers: None,
    };
    let error = gate
        .call_tool(
            CallToolRequestParams::new("charge"),
            RequestMetaObject::default(),
            origin,
        )
        .await
        .expect_err("refused");
    assert_eq!(error.code, ErrorCode(code::NOT_SENT), "{error:?}");
    let data = error.data.expect("data");
    assert_eq!(data["reason"], reason::PROXY_STOPPING, "{data}");
    assert_eq!(data["tool"], "charge");
    assert_eq!(data["permit_id"], "permit-1");
    assert_eq!(data["idempotency_key"], "mcp:session-1:4");
    assert_eq!(gate.calls.len(), 0, "no guarded call was started");
}

#[test]
fn the_approval_summary_names_the_tool_and_its_arguments_within_1024_bytes() {
    assert_eq!(
        approval_summary("charge", &json!({"amount": 500})),
        r#"charge {"amount":500}"#
    );
    assert_eq!(approval_summary("ping", &json!({})), "ping {}");
    // Cut on a character boundary, marked, never past atmost's limit.
    for filler in ["x", "é", "€", "𝄞"] {
        let summary = approval_summary("note", &json!({"text": filler.repeat(2000)}));
        assert!(summary.len() <= MAX_SUMMARY_BYTES, "{}", summary.len());
        assert!(summary.len() > MAX_SUMMARY_BYTES - 8, "{}", summary.len());
        assert!(summary.starts_with(r#"note {"text":""#) && summary.ends_with('…'));
    }
}

#[test]
fn a_call_awaiting_approval_is_a_tool_error_saying_to_call_again() {
    let ctx = Answer {
        permit: "permit-1",
        tool: "charge",
        key: "mcp:s:7",
    };
    // (GuardError::AwaitingApproval's answer; its AttemptId is atmost's
    // to make.) 2026-12-08T01:02:51Z:
    let CallToolResponse::Complete(result) = ctx.awaiting_approval("attempt-1", 1_796_691_771_000)
    else {
        panic!("not a tool result");
    };
    assert_eq!(result.is_error, Some(true));
    let text = text_of(&result);
    for said in [
        "Not sent",
        "approval",
        "same call again later",
        "same arguments",
        "\"mcp:s:7\"",
        "2026-12-08T01:02:51Z",
    ] {
        assert!(text.contains(said), "{said:?} not in {text:?}");
    }
    let meta = result.meta.expect("_meta").0;
    assert_eq!(meta[META_REASON], "AWAITING_APPROVAL");
    assert_eq!(meta[META_KEY_USED], "mcp:s:7");
    assert_eq!(meta[META_APPROVAL_EXPIRES_AT], "2026-12-08T01:02:51Z");
    assert_eq!(meta[META_REPLAYED], false);
    assert_eq!(meta[META_ATTEMPT_ID], "attempt-1");
    let structured = result.structured_content.expect("structuredContent");
    assert_eq!(structured["reason"], "AWAITING_APPROVAL");
    assert_eq!(structured["approval_expires_at_ms"], 1_796_691_771_000_i64);
    assert_eq!(structured["message"], text.as_str());
    assert_eq!(structured["idempotency_key"], "mcp:s:7");
    // Not known: said without a time.
    let CallToolResponse::Complete(result) = ctx.awaiting_approval("attempt-1", 0) else {
        panic!("not a tool result");
    };
    assert!(text_of(&result).contains("in time"));
    assert!(
        !result
            .meta
            .expect("_meta")
            .0
            .contains_key(META_APPROVAL_EXPIRES_AT)
    );
}
