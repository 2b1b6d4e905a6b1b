use super::*;

/// The flags of `argv` alone: every variable (ATMOST_MCP_PERMIT and the
/// like) cut off, so that one exported in the shell running the tests
/// changes nothing.
fn try_args(argv: &[&str]) -> Result<Args, clap::Error> {
    let command = Args::command().mut_args(|arg| arg.env(None::<&str>));
    let matches =
        command.try_get_matches_from(std::iter::once("atmost-mcp").chain(argv.iter().copied()))?;
    Args::from_matches(&matches)
}

fn args(argv: &[&str]) -> Args {
    try_args(argv).expect("the flags parse")
}

#[test]
fn a_cost_table_gives_each_tool_its_cost_and_the_rest_the_default() {
    let costs =
        Costs::parse("default = 3\n[tools]\n\"wallet.charge\" = 500\nsearch = 0\n").unwrap();
    assert_eq!(costs.of("wallet.charge"), 500);
    assert_eq!(costs.of("search"), 0);
    assert_eq!(costs.of("anything.else"), 3);
    assert_eq!(Costs::parse("").unwrap().of("x"), 0);
    assert_eq!(Costs::default().of("x"), 0);
}

#[test]
fn a_cost_table_with_a_bad_entry_is_refused_naming_it() {
    let max = Costs::parse("[tools]\nbig = 9007199254740991\n").unwrap();
    assert_eq!(max.of("big"), (1 << 53) - 1);
    for (text, says) in [
        ("default = -1", "default = -1"),
        ("[tools]\nbig = 9007199254740992", "tools.\"big\""),
        ("[tools]\ncharge = 1.5", "invalid type"),
        ("budget = 3", "unknown field"),
        ("[tool]\ncharge = 3", "unknown field"),
        ("default = ", "TOML parse error"),
    ] {
        let error = Costs::parse(text).expect_err(text);
        assert!(error.contains(says), "{text:?}: {error}");
    }
}

#[test]
fn the_upstream_is_a_url_or_a_command_never_both() {
    let http = args(&["--permit", "p", "--upstream", "http://127.0.0.1:8000/mcp"]);
    assert_eq!(
        http.upstream_spec().unwrap(),
        UpstreamSpec::Http {
            url: "http://127.0.0.1:8000/mcp".into(),
            ca: None
        }
    );
    let child = args(&["--permit", "p", "--", "python3", "server.py", "--stdio"]);
    assert_eq!(
        child.upstream_spec().unwrap(),
        UpstreamSpec::Command {
            program: "python3".into(),
            args: vec!["server.py".into(), "--stdio".into()]
        }
    );
    let both = args(&["--upstream", "http://x/mcp", "--", "python3"]);
    assert!(both.upstream_spec().unwrap_err().contains("not both"));
    assert!(
        args(&[])
            .upstream_spec()
            .unwrap_err()
            .contains("no upstream")
    );
    let ftp = args(&["--upstream", "ftp://x"]);
    assert!(ftp.upstream_spec().unwrap_err().contains("http://"));
    let ca_without_tls = args(&["--upstream", "http://x/mcp", "--upstream-tls-ca", "ca.pem"]);
    assert!(
        ca_without_tls
            .upstream_spec()
            .unwrap_err()
            .contains("https://")
    );
    let ca = args(&["--upstream", "https://x/mcp", "--upstream-tls-ca", "ca.pem"]);
    assert!(matches!(
        ca.upstream_spec().unwrap(),
        UpstreamSpec::Http { ca: Some(_), .. }
    ));
}

#[test]
fn the_permit_comes_from_the_flag_or_a_header() {
    let fixed = args(&["--permit", "p-1"]).permit_source().unwrap();
    assert!(matches!(fixed, PermitSource::Fixed(p) if p == "p-1"));
    let header = args(&["--permit-header", "X-Atmost-Permit"])
        .permit_source()
        .unwrap();
    assert!(matches!(header, PermitSource::Header(h) if h.as_str() == "x-atmost-permit"));
    // Both: refused, whichever would have won (a header overriding the
    // pinned permit lets any agent name any permit of the tenant).
    let both = args(&["--permit", "p-1", "--permit-header", "x-p"]).permit_source();
    let error = both.unwrap_err();
    assert!(
        error.contains("--permit ")
            && error.contains("--permit-header")
            && error.contains("not both"),
        "{error}"
    );
    assert!(args(&[]).permit_source().unwrap_err().contains("no permit"));
    assert!(
        args(&["--permit", " "])
            .permit_source()
            .unwrap_err()
            .contains("--permit (ATMOST_MCP_PERMIT) is empty")
    );
    let bad = args(&["--permit-header", "not a header"]).permit_source();
    assert!(
        bad.unwrap_err()
            .contains("(ATMOST_MCP_PERMIT_HEADER) \"not a header\": not an HTTP header name")
    );
    let stdio = args(&["--stdio", "--permit-header", "x-p"]).permit_source();
    assert!(stdio.unwrap_err().contains("needs HTTP"));
}

#[test]
fn listen_and_stdio_do_not_go_together() {
    assert!(try_args(&["--stdio", "--listen", "127.0.0.1:1"]).is_err());
    assert!(args(&["--stdio"]).stdio);
}

#[test]
fn a_dispatch_timeout_of_0_is_refused() {
    // 0 would leave the guarded call no time to send anything: every
    // tools/call would fail (-32603), so it is refused before serving.
    for zero in ["0s", "0ms", "0"] {
        let error = try_args(&["--dispatch-timeout", zero]).expect_err(zero);
        assert_eq!(error.exit_code(), 2, "{zero}");
        let text = error.to_string();
        assert!(
            text.contains("--dispatch-timeout") && text.contains("no time to send any call"),
            "{zero}: {text}"
        );
    }
    assert_eq!(
        args(&["--dispatch-timeout", "1ms"]).dispatch_timeout,
        Some(Duration::from_millis(1))
    );
    assert_eq!(args(&[]).dispatch_timeout, None);
}

#[test]
fn a_call_waits_for_approval_only_when_told_to() {
    let plain = args(&["--permit", "p", "--upstream", "http://127.0.0.1:8000/mcp"]);
    assert_eq!(plain.approval_wait, Duration::ZERO);
    let waiting = args(&[
        "--permit",
        "p",
        "--upstream",
        "http://127.0.0.1:8000/mcp",
        "--approval-wait",
        "2m",
    ]);
    assert_eq!(waiting.approval_wait, Duration::from_secs(120));
    assert!(
        try_args(&[
            "--permit",
            "p",
            "--upstream",
            "http://127.0.0.1:8000/mcp",
            "--approval-wait",
            "soon"
        ])
        .is_err()
    );
}
