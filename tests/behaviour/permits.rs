//! CreatePermit, GetPermit and RevokePermit: defaults, refusals, unknown ids.

use super::*;

on_both_stores!(
    create_permit_fills_defaults,
    create_permit_rejects_bad_input,
    unknown_permit_is_not_found,
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
