//! CreatePermit, GetPermit and RevokePermit: defaults, refusals, unknown ids.

use super::*;

on_both_stores!(
    create_permit_fills_defaults,
    create_permit_rejects_bad_input,
    unknown_permit_is_not_found,
    a_permit_is_forgotten_a_retention_after_it_expires_and_not_before,
    a_hostile_permit_gets_a_small_error,
);

async fn create_permit_fills_defaults(h: Harness) {
    let mut p = h.permit(&["search", "payments.charge"]);
    p.max_calls_per_tool.insert("payments.charge".into(), 3);
    p.budget = Some(1000);
    let created = h.create(p.clone()).await;
    assert!(uuid::Uuid::parse_str(&created.permit_id).is_ok());
    assert_eq!(created.tools, p.tools);
    assert_eq!(created.status(), pb::PermitStatus::Active);
    assert_eq!(created.lease.as_ref().map(|d| d.seconds), Some(30));
    let guard = created.duplicate_guard.expect("guard");
    assert_eq!(guard.mode(), pb::DuplicateGuardMode::Log);
    assert_eq!(guard.window.map(|d| d.seconds), Some(600));
    assert!(created.created_at.is_some());
    assert_eq!(created.expires_at, p.expires_at);

    let got = h.get(&created.permit_id).await.expect("get");
    assert_eq!(got.permit.as_ref(), Some(&created));
    assert_eq!(got.budget_committed, 0);
    assert_eq!(got.budget_reserved, 0);
    assert_eq!(got.budget_remaining, Some(1000));
    let usage: Vec<_> = got
        .usage
        .iter()
        .map(|u| {
            (
                u.tool.as_str(),
                u.calls_made,
                u.calls_limit,
                u.budget_remaining,
            )
        })
        .collect();
    assert_eq!(
        usage,
        vec![
            ("search", 0, None, Some(1000)),
            ("payments.charge", 0, Some(3), Some(1000)),
        ]
    );
}

async fn create_permit_rejects_bad_input(h: Harness) {
    type Mutation = Box<dyn Fn(&mut pb::Permit)>;
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "permit.permit_id",
            Box::new(|p| p.permit_id = uuid::Uuid::now_v7().to_string()),
        ),
        (
            "permit.max_calls_per_tool",
            Box::new(|p| {
                p.max_calls_per_tool.insert("other".into(), 1);
            }),
        ),
        ("permit.expires_at", Box::new(|p| p.expires_at = None)),
        ("permit.tools", Box::new(|p| p.tools.clear())),
        (
            "permit.tools",
            Box::new(|p| p.tools.push("bad tool".into())),
        ),
        ("permit.tools", Box::new(|p| p.tools.push("search".into()))),
        (
            "permit.tools",
            Box::new(|p| p.tools = (0..257).map(|i| format!("t{i}")).collect()),
        ),
        ("permit.budget", Box::new(|p| p.budget = Some(-1))),
        ("permit.budget", Box::new(|p| p.budget = Some(1 << 53))),
        (
            "permit.max_calls_per_tool",
            Box::new(|p| {
                p.max_calls_per_tool.insert("search".into(), u64::MAX);
            }),
        ),
        (
            "permit.status",
            Box::new(|p| p.status = pb::PermitStatus::Revoked as i32),
        ),
        (
            "permit.lease",
            Box::new(|p| {
                p.lease = Some(prost_types::Duration {
                    seconds: 0,
                    nanos: 0,
                })
            }),
        ),
    ];
    for (field, mutate) in cases {
        let mut p = h.permit(&["search"]);
        mutate(&mut p);
        let result = h.client.create_permit(p).await;
        let (_, status) = expect_error(result, Code::InvalidArgument, "INVALID_REQUEST");
        assert!(
            status.violated_fields().iter().any(|f| f == field),
            "{field}: {status:?}"
        );
    }
    // An expiry in the past.
    let mut p = h.permit(&["search"]);
    p.expires_at = Some(atmost_client::timestamp(h.now_ms() - 1));
    let result = h.client.create_permit(p).await;
    expect_error(result, Code::InvalidArgument, "INVALID_REQUEST");
}

async fn unknown_permit_is_not_found(h: Harness) {
    let id = uuid::Uuid::now_v7().to_string();
    let (meta, _) = expect_error(
        h.authorize(&id, "search", "k1", b"fp", 1).await,
        Code::NotFound,
        "PERMIT_NOT_FOUND",
    );
    assert_eq!(meta["permit_id"], id);
    expect_error(h.get(&id).await, Code::NotFound, "PERMIT_NOT_FOUND");
    let revoke = h.client.revoke_permit(&id).await;
    expect_error(revoke, Code::NotFound, "PERMIT_NOT_FOUND");
    expect_error(
        h.list(&id, 10, "").await,
        Code::NotFound,
        "PERMIT_NOT_FOUND",
    );
}

/// Both stores forget a permit at the same instant: once the clock is past
/// its expiry plus the retention (a day here), or past its last open
/// attempt's settling plus the retention; never while one is open.
async fn a_permit_is_forgotten_a_retention_after_it_expires_and_not_before(h: Harness) {
    let expires_at = h.now_ms() + 3_600_000;
    let done = h.create_with(&["t"], &[], None).await;
    let a = h.dispatch(&done, "t", "k", b"fp", 0).await;
    h.commit(&a, succeeded(b"ok", None)).await.expect("commit");
    let open = h.create_with(&["t"], &[], None).await;
    let b = h.dispatch(&open, "t", "k", b"fp", 0).await;
    h.mark_uncertain(&b, "lost").await.expect("mark");

    // At the last instant of the retention, everything still answers.
    h.clock.set(expires_at + DAY_MS);
    let replay = h
        .authorize(&done, "t", "k", b"fp", 0)
        .await
        .expect("replay");
    assert_eq!(replay.decision(), Decision::Replay);
    h.get(&done).await.expect("still kept");

    // One millisecond later it is gone, for every RPC.
    h.clock.advance(1);
    for result in [
        h.get(&done).await.map(drop),
        h.authorize(&done, "t", "k", b"fp", 0).await.map(drop),
        h.commit(&a, succeeded(b"ok", None)).await.map(drop),
        h.list(&done, 10, "").await.map(drop),
        h.client.revoke_permit(&done).await.map(drop),
    ] {
        expect_error(result, Code::NotFound, "PERMIT_NOT_FOUND");
    }
    // The permit with an UNCERTAIN attempt is kept, and listed, until it
    // is resolved; then it is kept for a retention from then.
    let listed = h.list_all("", 10).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].permit_id, open);
    h.resolve(&open, "k", resolved_failed("declined"))
        .await
        .expect("resolve");
    let resolved_at = h.now_ms();
    h.clock.set(resolved_at + DAY_MS);
    h.get(&open)
        .await
        .expect("kept a retention after the settle");
    h.clock.advance(1);
    expect_error(h.get(&open).await, Code::NotFound, "PERMIT_NOT_FOUND");
}

/// A permit built to make the error huge (a 60 KB tool name, 2000
/// malformed tools, 2000 caps of tools not in scope: as much as fits under
/// `--max-request-bytes`) gets a short one: at most 16 violations and a
/// count of the rest, each echoing at most a short escaped prefix, a few
/// KiB in all. (Larger requests are refused by the transport: the
/// campaign, tests/campaign.rs.)
async fn a_hostile_permit_gets_a_small_error(h: Harness) {
    let mut p = h.permit(&["t"]);
    p.tools.push("x".repeat(60_000));
    p.tools.extend((0..2_000).map(|i| format!("bad tool\n{i}")));
    p.max_calls_per_tool = (0..2_000).map(|i| (format!("nope-{i}"), 1)).collect();
    let (_, error) = expect_error(
        h.client.create_permit(p).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    let status = error.status();
    let violations = error.violated_fields();
    assert_eq!(
        violations.len(),
        atmost::domain::MAX_VIOLATIONS + 1,
        "{violations:?}"
    );
    assert!(
        status.message().len() < 4096,
        "message of {} bytes",
        status.message().len()
    );
    assert!(
        status.details().len() < 8192,
        "details of {} bytes",
        status.details().len()
    );
    assert!(status.message().contains("and "), "{}", status.message());
    assert!(
        status.message().contains("(60000 bytes)"),
        "{}",
        status.message()
    );
    assert!(!status.message().contains('\n'), "escaped");
}
