use super::*;

fn sha(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn file(entries: &[(&str, &str, &str, &str)]) -> String {
    entries
        .iter()
        .map(|(id, key, tenant, roles)| {
            format!(
                "[[key]]\nid = \"{id}\"\nsha256 = \"{}\"\ntenant = \"{tenant}\"\nroles = [{roles}]\n",
                sha(key)
            )
        })
        .collect()
}

#[test]
fn a_key_is_known_by_its_digest_only() {
    let keys = Keys::parse(&file(&[
        ("ops-1", "secret-ops", "acme", "\"operator\""),
        ("agent-1", "secret-agent", "acme", "\"agent\", \"operator\""),
    ]))
    .expect("parses");
    assert_eq!(keys.len(), 2);
    let agent = keys.authenticate(b"secret-agent").expect("known");
    assert_eq!(agent.key_id, "agent-1");
    assert_eq!(agent.tenant, "acme");
    assert_eq!(agent.roles, [Role::Agent, Role::Operator]);
    assert_eq!(
        keys.authenticate(b"secret-ops").expect("known").key_id,
        "ops-1"
    );
    for unknown in [
        &b"secret-agen"[..],
        b"secret-agent ",
        b"",
        &sha("secret-agent").into_bytes(),
    ] {
        assert!(keys.authenticate(unknown).is_none());
    }
    // Upper-case hex is the same digest.
    let upper = file(&[("a", "k", "t", "\"admin\"")]).replace(&sha("k"), &sha("k").to_uppercase());
    assert!(
        Keys::parse(&upper)
            .expect("parses")
            .authenticate(b"k")
            .is_some()
    );
}

#[test]
fn a_broken_file_names_the_entry_and_why() {
    let cases = [
        (
            file(&[("ops 1", "k", "acme", "\"operator\"")]),
            "id must be",
        ),
        (
            file(&[
                ("a", "k1", "acme", "\"agent\""),
                ("a", "k2", "acme", "\"agent\""),
            ]),
            "id is given twice",
        ),
        (
            file(&[
                ("a", "k", "acme", "\"agent\""),
                ("b", "k", "acme", "\"agent\""),
            ]),
            "same key is listed twice",
        ),
        (file(&[("a", "k", "", "\"agent\"")]), "tenant must be"),
        (file(&[("a", "k", "acme", "")]), "at least one role"),
        (
            file(&[("a", "k", "acme", "\"root\"")]),
            "unknown role \"root\"",
        ),
        (
            file(&[("a", "k", "acme", "\"agent\"")]).replace(&sha("k"), "abc"),
            "sha256 must be 64 hex digits",
        ),
        (
            file(&[("a", "k", "acme", "\"agent\"")]).replace(&sha("k"), &"zz".repeat(32)),
            "sha256 must be 64 hex digits",
        ),
        ("[[key]]\nid = \"a\"\n".to_owned(), "missing field"),
        (
            format!("{}extra = 1\n", file(&[("a", "k", "acme", "\"agent\"")])),
            "unknown field",
        ),
        ("not toml".to_owned(), "line 1"),
    ];
    for (text, why) in cases {
        let e = Keys::parse(&text).expect_err(&text);
        assert!(e.contains(why), "{text:?}: {e}");
    }
    assert!(Keys::parse("").expect("an empty file").is_empty());
}

#[test]
fn every_rpc_names_its_roles() {
    use Role::{Admin, Agent, Approver, Operator};
    for (path, roles) in [
        ("/atmost.v1.Gate/Authorize", &[Agent, Admin][..]),
        ("/atmost.v1.Gate/Commit", &[Agent, Admin]),
        ("/atmost.v1.Gate/MarkUncertain", &[Agent, Admin]),
        (
            "/atmost.v1.Permits/GetPermit",
            &[Agent, Operator, Approver, Admin],
        ),
        (
            "/atmost.v1.Permits/GetAttempt",
            &[Agent, Operator, Approver, Admin],
        ),
        ("/atmost.v1.Approvals/ListApprovals", &[Approver, Admin]),
        ("/atmost.v1.Approvals/Approve", &[Approver, Admin]),
        ("/atmost.v1.Approvals/Deny", &[Approver, Admin]),
        ("/atmost.v1.Approvals/SomethingNew", &[Admin]),
        ("/atmost.v1.Permits/ListUncertain", &[Operator, Admin]),
        ("/atmost.v1.Permits/Resolve", &[Operator, Admin]),
        ("/atmost.v1.Permits/CreatePermit", &[Admin]),
        ("/atmost.v1.Permits/RevokePermit", &[Admin]),
        ("/atmost.v1.Permits/SomethingNew", &[Admin]),
        // The Envoy front doors: a gateway authorizes and settles calls.
        (
            "/envoy.service.auth.v3.Authorization/Check",
            &[Agent, Admin],
        ),
        (
            "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
            &[Agent, Admin],
        ),
        ("/envoy.service.auth.v3.Authorization/Check/", &[Admin]),
        ("/envoy.service.auth.v2.Authorization/Check", &[Admin]),
        (
            "/envoy.service.ext_proc.v3.ExternalProcessor/Other",
            &[Admin],
        ),
        // Fails closed: any other path, or a variant of an atmost one.
        ("/atmost.v2.Gate/Authorize", &[Admin]),
        ("/Atmost.v1.Gate/Authorize", &[Admin]),
        ("/atmost.v1.Gate/Authorize/", &[Admin]),
        ("/grpc.health.v2.Health/Check", &[Admin]),
        ("/atmost.v1.Receipts/SomethingNew", &[Admin]),
        ("/atmost.v1.Receipts/GetSigningKeysX", &[Admin]),
        ("", &[Admin]),
    ] {
        assert_eq!(allowed_roles(path), Some(roles), "{path}");
    }
    for open in [
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
        "/atmost.v1.Receipts/GetSigningKeys",
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    ] {
        assert_eq!(allowed_roles(open), None, "{open}");
    }
}

#[test]
fn a_syntax_error_names_the_line_never_its_text() {
    let secret = "sk-live-0123456789";
    let text = format!("[[key]]\nid = \"a\"\nkey = \"{secret}\" oops\n");
    let e = Keys::parse(&text).expect_err("broken");
    assert!(e.starts_with("line 3"), "{e}");
    assert!(!e.contains(secret), "{e}");
}
