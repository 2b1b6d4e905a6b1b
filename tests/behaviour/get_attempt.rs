//! GetAttempt: one key's attempt, in every state, as every reader sees it;
//! an open attempt's fencing token withheld; unknown keys and permits;
//! malformed requests. A read changes nothing. (These run in dev mode, where
//! every caller may reconcile; what each role reads is in tests/auth.rs.)

use super::*;

on_both_stores!(
    get_attempt_reads_every_state_as_a_replay_would,
    get_attempt_never_hands_a_reader_the_token_of_a_reserved_attempt,
    get_attempt_of_an_unknown_key_or_permit_is_not_found,
    get_attempt_refuses_malformed_input_whole,
);

async fn get_attempt_reads_every_state_as_a_replay_would(h: Harness) {
    let permit = h.create_with(&["t"], &[], Some(100)).await;
    let read = |key: &'static str| {
        let (client, permit) = (h.client.clone(), permit.clone());
        async move {
            client
                .get_attempt(&permit, key)
                .await
                .unwrap_or_else(|e| panic!("get {key}: {e:?}"))
                .attempt
                .expect("an attempt")
        }
    };
    let reserved = h.dispatch(&permit, "t", "reserved", b"1", 1).await;
    // All but the attempt_id: the holder's fencing token.
    assert!(!reserved.attempt_id.is_empty());
    assert_eq!(
        read("reserved").await,
        pb::Attempt {
            attempt_id: String::new(),
            ..reserved.clone()
        }
    );

    let ok = h.dispatch(&permit, "t", "ok", b"2", 2).await;
    let committed = h
        .commit(&ok, succeeded(b"tx 7", Some(1)))
        .await
        .expect("commit")
        .attempt
        .expect("a");
    let got = read("ok").await;
    assert_eq!(got, committed);
    assert_eq!(state(&got), AttemptState::Succeeded);
    let receipt = got.receipt.expect("a receipt");
    assert_eq!((receipt.result.as_slice(), receipt.cost), (&b"tx 7"[..], 1));

    let no = h.dispatch(&permit, "t", "no", b"3", 3).await;
    h.commit(&no, failed("declined")).await.expect("commit");
    let got = read("no").await;
    assert_eq!(
        (state(&got), got.failure_reason.as_str()),
        (AttemptState::Failed, "declined")
    );

    let lost = h.dispatch(&permit, "t", "lost", b"4", 4).await;
    h.mark_uncertain(&lost, "client deadline")
        .await
        .expect("mark");
    let got = read("lost").await;
    assert_eq!(
        (state(&got), got.uncertain_reason.as_str()),
        (AttemptState::Uncertain, "client deadline")
    );
    // UNCERTAIN: dev mode's caller may Resolve it, so it reads the id, as
    // ListUncertain shows it.
    assert_eq!(got.attempt_id, lost.attempt_id);

    let back = h.dispatch(&permit, "t", "back", b"5", 5).await;
    h.commit(&back, not_sent()).await.expect("commit");
    assert_eq!(state(&read("back").await), AttemptState::Released);

    // Past its lease a RESERVED attempt reads UNCERTAIN, as a replay
    // answers it, and listed the same.
    h.clock.advance(30_000);
    let got = read("reserved").await;
    assert_eq!(
        (state(&got), got.uncertain_reason.as_str()),
        (AttemptState::Uncertain, "lease_expired")
    );
    let replay = h
        .authorize(&permit, "t", "reserved", b"1", 1)
        .await
        .expect("replay");
    assert_eq!(replay.attempt.as_ref(), Some(&got));
    let listed = h.list_all(&permit, 10).await;
    assert!(listed.contains(&got), "{listed:?}");

    // Reading changed nothing: usage and budget are as the calls left them.
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 4);
    assert_eq!(budget(&h, &permit).await, (1, 5, Some(94)));
}

/// The attempt_id is the fencing token Commit takes. Read back from a
/// RESERVED attempt it would let a reader Commit NotSent while the holder
/// is still sending: the slot and the key freed, and a second DISPATCH for
/// the same key. GetAttempt leaves it empty, so the read settles nothing.
async fn get_attempt_never_hands_a_reader_the_token_of_a_reserved_attempt(h: Harness) {
    let permit = h.create_with(&["t"], &[("t", 1)], None).await;
    let held = h.dispatch(&permit, "t", "k", b"fp", 0).await;
    let read = h
        .client
        .get_attempt(&permit, "k")
        .await
        .expect("get")
        .attempt
        .expect("an attempt");
    assert_eq!(state(&read), AttemptState::Reserved);
    assert_eq!(read.attempt_id, "");
    // What a reader could try with it: refused, and nothing changed.
    let (_, e) = expect_error(
        h.commit(&read, not_sent()).await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(e.violated_fields(), ["attempt_id"]);
    expect_error(
        h.authorize(&permit, "t", "k", b"fp", 0).await,
        Code::Aborted,
        "IDEMPOTENCY_IN_PROGRESS",
    );
    assert_eq!(usage_of(&h, &permit, "t").await.calls_made, 1);
    // The holder, who has the id from Authorize, still settles it.
    h.commit(&held, not_sent())
        .await
        .expect("the holder's NotSent");
}

async fn get_attempt_of_an_unknown_key_or_permit_is_not_found(h: Harness) {
    let permit = h.create_with(&["t"], &[], None).await;
    h.dispatch(&permit, "t", "k", b"fp", 0).await;
    let (meta, _) = expect_error(
        h.client.get_attempt(&permit, "never-seen").await,
        Code::NotFound,
        "ATTEMPT_NOT_FOUND",
    );
    assert_eq!(meta["idempotency_key"], "never-seen");
    let unknown = uuid::Uuid::now_v7().to_string();
    let (meta, _) = expect_error(
        h.client.get_attempt(&unknown, "k").await,
        Code::NotFound,
        "PERMIT_NOT_FOUND",
    );
    assert_eq!(meta["permit_id"], unknown);
    // The permit named in another form of its UUID is the same permit.
    let upper = permit.to_uppercase();
    let got = h.client.get_attempt(&upper, "k").await.expect("upper case");
    assert_eq!(got.attempt.expect("a").permit_id, permit);
}

async fn get_attempt_refuses_malformed_input_whole(h: Harness) {
    let (_, e) = expect_error(
        h.client.get_attempt("not-a-uuid", "").await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(e.violated_fields(), ["permit_id", "idempotency_key"]);
    let permit = h.create_with(&["t"], &[], None).await;
    let (_, e) = expect_error(
        h.client.get_attempt(&permit, "tab\tkey").await,
        Code::InvalidArgument,
        "INVALID_REQUEST",
    );
    assert_eq!(e.violated_fields(), ["idempotency_key"]);
}
