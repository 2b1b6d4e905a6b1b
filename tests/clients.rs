//! The Rust client's guarded call (`Client::guarded`) against a live atmost
//! over gRPC, on each store: the contract every client helper keeps
//! (docs in client/README.md). A fake tool counts what it is asked to send,
//! so "never sent twice" is counted, not assumed.

use crate::support::*;
use atmost::store::{Backend, Store};
use atmost_client::{
    AttemptId, DispatchError, Dispatched, GuardError, GuardedCall, Reason, Unrecorded, fingerprint,
};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::Code;

on_each_store!(
    dispatch_commits_and_the_same_key_replays,
    a_new_key_past_the_cap_is_denied_with_its_numbers,
    a_tool_refusal_is_recorded_failed,
    not_sent_gives_the_slot_back,
    a_hung_dispatch_ends_uncertain_and_is_never_sent_again,
    a_dispatch_cut_off_is_dropped_before_its_outcome_is_reported,
    an_error_in_dispatch_ends_uncertain,
    the_lease_bounds_dispatch_without_a_timeout,
    a_dispatch_timeout_never_outlasts_the_lease,
    a_restart_with_a_kept_token_settles_the_attempt_and_never_sends_again,
    a_lost_answer_to_the_calls_own_token_is_dispatched_once,
    a_redelivery_late_in_the_lease_gets_only_what_is_left,
    an_answer_slow_to_come_back_leaves_dispatch_only_what_is_left,
    a_panicking_retry_hook_does_not_stop_the_retry,
    a_panicking_dispatch_is_marked_uncertain_then_resumes,
    an_actual_cost_out_of_range_is_not_recorded_and_the_result_kept,
    a_server_not_up_yet_is_retried_until_it_is,
    an_outcome_atmost_refuses_to_record_says_so,
    an_outcome_the_server_is_gone_for_says_so,
    a_result_over_64_kib_is_stored_as_its_digest,
    a_bearer_key_is_sent_and_a_wrong_one_is_not_retried,
    tls_and_mtls,
);

const TOOL: &str = "wallet.charge";

/// The tool behind the guarded calls: counts every send and the attempt
/// ids it was given (its own idempotency keys).
#[derive(Clone, Default)]
struct FakeTool {
    sent: Arc<AtomicUsize>,
    ids: Arc<Mutex<Vec<String>>>,
}

impl FakeTool {
    fn sent(&self) -> usize {
        self.sent.load(Ordering::SeqCst)
    }

    fn ids(&self) -> Vec<String> {
        self.ids.lock().expect("ids").clone()
    }

    fn record(&self, id: &AttemptId) {
        self.sent.fetch_add(1, Ordering::SeqCst);
        self.ids.lock().expect("ids").push(id.to_string());
    }

    /// A dispatch that charges and answers `wallet tx <n>`.
    fn charge(
        &self,
    ) -> impl FnOnce(AttemptId) -> std::future::Ready<Result<Vec<u8>, DispatchError>> {
        let tool = self.clone();
        move |id| {
            tool.record(&id);
            std::future::ready(Ok(format!("wallet tx {}", tool.sent()).into_bytes()))
        }
    }

    /// A dispatch that sends, then never hears back.
    fn hang(
        &self,
    ) -> impl FnOnce(AttemptId) -> std::future::Pending<Result<Vec<u8>, DispatchError>> {
        let tool = self.clone();
        move |id| {
            tool.record(&id);
            std::future::pending()
        }
    }

    /// A dispatch that answers with this error.
    fn fail(
        &self,
        error: DispatchError,
    ) -> impl FnOnce(AttemptId) -> std::future::Ready<Result<Vec<u8>, DispatchError>> {
        let tool = self.clone();
        move |id| {
            tool.record(&id);
            std::future::ready(Err(error))
        }
    }
}

fn charge_request(amount: i64) -> serde_json::Value {
    serde_json::json!({"amount": amount, "currency": "EUR", "to": "acct_42"})
}

fn call(permit_id: &str, key: &str) -> GuardedCall {
    GuardedCall::new(permit_id, TOOL, key)
        .request(&charge_request(500))
        .cost(500)
}

/// A permit over TOOL with this cap.
async fn permit(h: &Harness, cap: u64) -> String {
    h.create_with(&[TOOL], &[(TOOL, cap)], Some(10_000)).await
}

async fn calls_made(h: &Harness, permit_id: &str) -> u64 {
    h.get(permit_id).await.expect("get permit").usage[0].calls_made
}

// === the contract ===

/// DISPATCH, the tool's answer committed with a receipt; the same key
/// again replays it without calling dispatch.
async fn dispatch_commits_and_the_same_key_replays(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 2).await;
    let tool = FakeTool::default();
    let first = h
        .client
        .guarded(call(&p, "charge-1"), {
            let tool = tool.clone();
            move |id| async move {
                tool.record(&id);
                Ok::<_, DispatchError>(Dispatched::bytes("wallet tx 981").actual_cost(300))
            }
        })
        .await
        .expect("dispatched and committed");
    assert!(!first.replayed);
    assert_eq!(first.result, b"wallet tx 981");
    assert_eq!(first.receipt.result, b"wallet tx 981");
    assert_eq!(first.receipt.cost, 300, "the actual cost was committed");
    assert_eq!(first.attempt.state(), pb::AttemptState::Succeeded);
    assert_eq!(tool.ids(), [first.attempt.attempt_id.as_str()]);
    assert_eq!(
        first.attempt.request_fingerprint,
        fingerprint(&charge_request(500)).unwrap(),
        "the request's RFC 8785 fingerprint"
    );

    let again = h
        .client
        .guarded(call(&p, "charge-1"), tool.charge())
        .await
        .expect("replayed");
    assert!(again.replayed);
    assert_eq!(again.result, b"wallet tx 981");
    assert_eq!(again.receipt.receipt_id, first.receipt.receipt_id);
    assert_eq!(tool.sent(), 1, "a replay sends nothing");
    assert_eq!(calls_made(&h, &p).await, 1);
}

/// Cap 1 used, a new key: the typed refusal with the cap's numbers, and
/// nothing dispatched.
async fn a_new_key_past_the_cap_is_denied_with_its_numbers(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 1).await;
    let tool = FakeTool::default();
    h.client
        .guarded(call(&p, "charge-1"), tool.charge())
        .await
        .expect("the first call");
    let retries = Arc::new(AtomicUsize::new(0));
    let counted = retries.clone();
    let denied = h
        .client
        .guarded(
            call(&p, "charge-2").on_retry(move |_| {
                counted.fetch_add(1, Ordering::SeqCst);
            }),
            tool.charge(),
        )
        .await;
    let Err(GuardError::Denied(e)) = denied else {
        panic!("expected Denied, got {denied:?}");
    };
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(e.reason(), Some(Reason::PermitMaxCallsExceeded));
    assert_eq!(e.tool(), Some(TOOL));
    assert_eq!(e.limit(), Some(1));
    assert_eq!(e.calls_made(), Some(1));
    assert_eq!(tool.sent(), 1, "the second key sent nothing");
    assert_eq!(
        retries.load(Ordering::SeqCst),
        0,
        "a refusal is not retried"
    );
}

/// The tool refused: Commit Failed, the slot kept; the same key replays
/// the refusal.
async fn a_tool_refusal_is_recorded_failed(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 2).await;
    let tool = FakeTool::default();
    let refused = h
        .client
        .guarded(
            call(&p, "charge-1"),
            tool.fail(DispatchError::failed("card declined")),
        )
        .await;
    let Err(GuardError::ToolFailed {
        attempt_id,
        reason,
        replayed: false,
    }) = refused
    else {
        panic!("expected ToolFailed, got {refused:?}");
    };
    assert_eq!(reason, "card declined");
    assert_eq!(tool.ids(), [attempt_id.to_string()]);
    assert_eq!(calls_made(&h, &p).await, 1, "a failed call keeps its slot");

    let again = h.client.guarded(call(&p, "charge-1"), tool.charge()).await;
    let Err(GuardError::ToolFailed {
        attempt_id: replayed_id,
        reason,
        replayed: true,
    }) = again
    else {
        panic!("expected a replayed ToolFailed, got {again:?}");
    };
    assert_eq!(
        (replayed_id, reason.as_str()),
        (attempt_id, "card declined")
    );
    assert_eq!(tool.sent(), 1);
}

/// NotSent: the slot and the cost come back, so with cap 1 a new key
/// dispatches.
async fn not_sent_gives_the_slot_back(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 1).await;
    let tool = FakeTool::default();
    let unsent = h
        .client
        .guarded(call(&p, "charge-1"), tool.fail(DispatchError::NotSent))
        .await;
    assert!(
        matches!(unsent, Err(GuardError::NotSent { .. })),
        "{unsent:?}"
    );
    assert_eq!(calls_made(&h, &p).await, 0, "the slot came back");
    assert_eq!(h.get(&p).await.expect("get").budget_reserved, 0);
    let next = h
        .client
        .guarded(call(&p, "charge-2"), tool.charge())
        .await
        .expect("a new key dispatches on the returned slot");
    assert!(!next.replayed);
    assert_eq!(tool.sent(), 2);
}

/// A dispatch cut off at its deadline is dropped at once, not after the
/// MarkUncertain and its retries: whatever it holds (a connection whose
/// drop cancels the request, a lock) is let go before the report. The
/// MarkUncertain's first answer is lost, so its retry shows the order.
async fn a_dispatch_cut_off_is_dropped_before_its_outcome_is_reported(kind: Kind) {
    struct Held(Arc<std::sync::atomic::AtomicBool>);
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let h = Harness::start(kind).await;
    let p = permit(&h, 1).await;
    let relay = Relay::losing(h.addr, 2).await;
    let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let at_retry = Arc::new(Mutex::new(Vec::new()));
    let (flag, seen) = (dropped.clone(), at_retry.clone());
    let held = Held(dropped.clone());
    let lost = relay
        .client()
        .guarded(
            call(&p, "charge-1")
                .dispatch_timeout(Duration::from_millis(200))
                .on_retry(move |r| {
                    seen.lock()
                        .expect("retries")
                        .push((r.rpc, flag.load(Ordering::SeqCst)))
                }),
            move |_| async move {
                let _held = held;
                std::future::pending::<Result<Vec<u8>, DispatchError>>().await
            },
        )
        .await;
    assert!(relay.struck(), "the MarkUncertain's first answer was lost");
    assert!(
        matches!(lost, Err(GuardError::OutcomeUncertain { .. })),
        "{lost:?}"
    );
    assert_eq!(
        *at_retry.lock().expect("retries"),
        [("MarkUncertain", true)],
        "the dispatch was dropped before the report was retried"
    );
}

/// The lost response: dispatch sends and never hears back. At its deadline
/// it is dropped and marked UNCERTAIN, sent once only; the same key
/// afterwards is the same unknown, and sends nothing.
async fn a_hung_dispatch_ends_uncertain_and_is_never_sent_again(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 3).await;
    let tool = FakeTool::default();
    let lost = h
        .client
        .guarded(
            call(&p, "charge-1").dispatch_timeout(Duration::from_millis(200)),
            tool.hang(),
        )
        .await;
    let Err(GuardError::OutcomeUncertain {
        attempt_id,
        reason,
        replayed: false,
        source: Some(source),
    }) = lost
    else {
        panic!("expected OutcomeUncertain, got {lost:?}");
    };
    assert!(
        source.is::<tokio::time::error::Elapsed>(),
        "chained to the timeout: {source:?}"
    );
    assert_eq!(
        reason,
        "dispatch still running at its deadline, 200ms after the DISPATCH: dropped"
    );
    let uncertain = h.list_all(&p, 0).await;
    assert_eq!(uncertain.len(), 1, "{uncertain:?}");
    assert_eq!(uncertain[0].attempt_id, attempt_id.as_str());
    assert_eq!(uncertain[0].uncertain_reason, reason);
    assert_eq!(tool.sent(), 1);

    let again = h.client.guarded(call(&p, "charge-1"), tool.charge()).await;
    let Err(GuardError::OutcomeUncertain {
        attempt_id: same,
        replayed: true,
        source: None,
        ..
    }) = again
    else {
        panic!("expected the same unknown, got {again:?}");
    };
    assert_eq!(same, attempt_id);
    assert_eq!(tool.sent(), 1, "never sent again");
    assert_eq!(calls_made(&h, &p).await, 1, "the slot stays held");
}

/// Any error dispatch raises (a reset after sending, say) is an unknown
/// outcome: marked UNCERTAIN with what happened, chained to the error.
async fn an_error_in_dispatch_ends_uncertain(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 3).await;
    let tool = FakeTool::default();
    let reset = h
        .client
        .guarded(call(&p, "charge-1"), {
            let tool = tool.clone();
            move |id| async move {
                tool.record(&id);
                Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "reset after the request was written",
                ))?;
                Ok::<Vec<u8>, DispatchError>(Vec::new())
            }
        })
        .await;
    let Err(GuardError::OutcomeUncertain {
        attempt_id,
        reason,
        source: Some(source),
        ..
    }) = reset
    else {
        panic!("expected OutcomeUncertain, got {reset:?}");
    };
    assert!(source.is::<std::io::Error>(), "{source:?}");
    assert_eq!(
        reason,
        "dispatch failed: reset after the request was written"
    );
    let uncertain = h.list_all(&p, 0).await;
    assert_eq!(uncertain.len(), 1);
    assert_eq!(uncertain[0].attempt_id, attempt_id.as_str());
    assert_eq!(uncertain[0].uncertain_reason, reason);
    assert_eq!(tool.sent(), 1);
}

/// Without a dispatch timeout the deadline is the lease (by the server's
/// timestamps) less a second: a 1.5 s lease gives dispatch at most 500 ms
/// (the lease is counted from when the Authorize try was sent). A lease
/// that leaves no time is given back unsent, without calling dispatch.
async fn the_lease_bounds_dispatch_without_a_timeout(kind: Kind) {
    let h = Harness::start(kind).await;
    let mut short = h.permit(&[TOOL]);
    short.lease = Some(atmost_client::duration(Duration::from_millis(1_500)));
    let p = h.create(short).await.permit_id;
    let tool = FakeTool::default();
    let lost = h.client.guarded(call(&p, "charge-1"), tool.hang()).await;
    let Err(GuardError::OutcomeUncertain { reason, .. }) = lost else {
        panic!("expected OutcomeUncertain, got {lost:?}");
    };
    assert_eq!(
        reason,
        "dispatch still running at its deadline, 1s before the lease's end (1.5s left when the answered Authorize try was sent): dropped"
    );
    assert_eq!(tool.sent(), 1);

    let mut none_left = h.permit(&[TOOL]);
    none_left.lease = Some(atmost_client::duration(Duration::from_secs(1)));
    let q = h.create(none_left).await.permit_id;
    let late = h.client.guarded(call(&q, "charge-1"), tool.charge()).await;
    assert!(
        matches!(late, Err(GuardError::NoTimeToDispatch { .. })),
        "{late:?}"
    );
    assert_eq!(tool.sent(), 1, "not called");
    assert_eq!(calls_made(&h, &q).await, 0, "released unsent");
}

/// A dispatch timeout past the lease-based deadline is cut to it: past the
/// lease the attempt reads UNCERTAIN, an operator may resolve it NotSent
/// and the key be used again, and a call still being sent then would
/// exceed the cap. A 1.5 s lease with a 5 s timeout gives dispatch at most
/// 500 ms, the lease decides; a lease that leaves no time is given back
/// unsent, whatever the timeout.
async fn a_dispatch_timeout_never_outlasts_the_lease(kind: Kind) {
    let h = Harness::start(kind).await;
    let mut short = h.permit(&[TOOL]);
    short.lease = Some(atmost_client::duration(Duration::from_millis(1_500)));
    let p = h.create(short).await.permit_id;
    let tool = FakeTool::default();
    let long = call(&p, "charge-1").dispatch_timeout(Duration::from_secs(5));
    let lost = h.client.guarded(long, tool.hang()).await;
    let Err(GuardError::OutcomeUncertain {
        reason,
        replayed: false,
        ..
    }) = lost
    else {
        panic!("expected OutcomeUncertain, got {lost:?}");
    };
    assert_eq!(
        reason,
        "dispatch still running at its deadline, 1s before the lease's end (1.5s left when the answered Authorize try was sent): dropped"
    );
    assert_eq!(tool.sent(), 1);

    let mut none_left = h.permit(&[TOOL]);
    none_left.lease = Some(atmost_client::duration(Duration::from_secs(1)));
    let q = h.create(none_left).await.permit_id;
    let long = call(&q, "charge-1").dispatch_timeout(Duration::from_secs(5));
    let late = h.client.guarded(long, tool.charge()).await;
    assert!(
        matches!(late, Err(GuardError::NoTimeToDispatch { .. })),
        "{late:?}"
    );
    assert_eq!(tool.sent(), 1, "not called");
    assert_eq!(calls_made(&h, &q).await, 0, "released unsent");
}

/// A restart with a kept holder token: process A's guarded call reserves
/// and sends, then A dies before its Commit (its task is aborted while
/// dispatch runs). The restarted process makes the same call, with the
/// same key, request and token: atmost redelivers the DISPATCH, and the
/// call must not send again: HeldByEarlierRun names the attempt, and
/// nothing is recorded. Nothing says A never sent, so it is settled
/// uncertain: the slot stays held and the key replays the unknown. A
/// second key, whose run died before sending (its journal would say so),
/// is settled NotSent: the key is free, and the call made again is a fresh
/// DISPATCH, sent once. Another worker's token is told IN_PROGRESS.
async fn a_restart_with_a_kept_token_settles_the_attempt_and_never_sends_again(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 2).await;
    let tool = FakeTool::default();
    // Process A: `send` says whether its dispatch reached the tool before
    // it died.
    let crash = |key: &'static str, token: &[u8], send: bool| {
        let (client, tool) = (h.client.clone(), tool.clone());
        let call = call(&p, key).holder_token(token.to_vec());
        async move {
            let (entered, dispatching) = oneshot::channel();
            let run = tokio::spawn(async move {
                client
                    .guarded(call, move |id| {
                        if send {
                            tool.record(&id);
                        }
                        let _ = entered.send(());
                        std::future::pending::<Result<Vec<u8>, DispatchError>>()
                    })
                    .await
            });
            dispatching.await.expect("A dispatched");
            run.abort();
            assert!(run.await.expect_err("A died").is_cancelled());
        }
    };
    let restarted = Client::connect(format!("http://{}", h.addr))
        .await
        .expect("the restarted process connects");

    let token = b"kept in the journal with charge-1".to_vec();
    crash("charge-1", &token, true).await;
    assert_eq!(tool.sent(), 1);
    let other = restarted
        .guarded(
            call(&p, "charge-1").holder_token(b"another worker".to_vec()),
            tool.charge(),
        )
        .await;
    let Err(GuardError::InProgress(e)) = other else {
        panic!("expected InProgress, got {other:?}");
    };
    assert_eq!(e.reason(), Some(Reason::IdempotencyInProgress));
    let again = restarted
        .guarded(
            call(&p, "charge-1").holder_token(token.clone()),
            tool.charge(),
        )
        .await;
    let Err(GuardError::HeldByEarlierRun {
        attempt_id,
        attempt,
        lease_remaining: Some(left),
    }) = again
    else {
        panic!("expected HeldByEarlierRun, got {again:?}");
    };
    assert_eq!(tool.sent(), 1, "never sent again");
    assert_eq!(tool.ids(), [attempt_id.to_string()]);
    assert_eq!(attempt.attempt_id, attempt_id.as_str());
    assert_eq!(
        attempt.state(),
        pb::AttemptState::Reserved,
        "nothing recorded"
    );
    assert!(
        left <= Duration::from_secs(30),
        "within the permit's lease: {left:?}"
    );
    let settled = restarted
        .settle_uncertain(&attempt, "restarted: the earlier run may have sent")
        .await
        .expect("marked uncertain");
    assert_eq!(settled.state(), pb::AttemptState::Uncertain);
    let replayed = restarted
        .guarded(call(&p, "charge-1").holder_token(token), tool.charge())
        .await;
    assert!(
        matches!(&replayed, Err(GuardError::OutcomeUncertain { attempt_id: same, replayed: true, .. }) if *same == attempt_id),
        "{replayed:?}"
    );
    assert_eq!(calls_made(&h, &p).await, 1, "the slot stays held");

    let token = b"kept in the journal with charge-2".to_vec();
    crash("charge-2", &token, false).await;
    assert_eq!(tool.sent(), 1, "A died before sending charge-2");
    let again = restarted
        .guarded(
            call(&p, "charge-2").holder_token(token.clone()),
            tool.charge(),
        )
        .await;
    let Err(GuardError::HeldByEarlierRun { attempt, .. }) = again else {
        panic!("expected HeldByEarlierRun, got {again:?}");
    };
    let released = restarted.settle_not_sent(&attempt).await.expect("released");
    assert_eq!(released.state(), pb::AttemptState::Released);
    assert_eq!(calls_made(&h, &p).await, 1, "the slot came back");
    let outcome = restarted
        .guarded(call(&p, "charge-2").holder_token(token), tool.charge())
        .await
        .expect("a fresh DISPATCH to the kept token, sent");
    assert!(!outcome.replayed);
    assert_ne!(outcome.attempt.attempt_id, attempt.attempt_id);
    assert_eq!(tool.sent(), 2);
    assert_eq!(calls_made(&h, &p).await, 2);
}

/// The lost DISPATCH with the call's own random token: the first
/// Authorize's answer is lost after atmost reserved, the retry carries the
/// same token and gets the same attempt redelivered, and the call, which
/// knows it never sent, dispatches it exactly once.
async fn a_lost_answer_to_the_calls_own_token_is_dispatched_once(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 1).await;
    let relay = Relay::losing(h.addr, 1).await;
    let client = relay.client();
    let retried = Arc::new(Mutex::new(Vec::new()));
    let seen = retried.clone();
    let tool = FakeTool::default();
    let outcome = client
        .guarded(
            call(&p, "charge-1").on_retry(move |r| seen.lock().expect("retries").push(r.rpc)),
            tool.charge(),
        )
        .await
        .expect("redelivered, dispatched, committed");
    assert!(relay.struck(), "the first answer was lost");
    assert_eq!(*retried.lock().expect("retries"), ["Authorize"]);
    assert_eq!(tool.ids(), [outcome.attempt.attempt_id.as_str()]);
    assert_eq!(calls_made(&h, &p).await, 1, "nothing more was reserved");
}

/// A redelivery late in the lease gets what atmost says is left of it,
/// less the margin, not the whole lease: the first Authorize's answer is
/// lost, and the server's clock moves on before the retry. With 1.5 s of
/// a 3 s lease left, dispatch is given at most 500 ms, from that 1.5 s;
/// with 0.9 s left (under the margin) it is not called, and the attempt
/// is given back unsent.
async fn a_redelivery_late_in_the_lease_gets_only_what_is_left(kind: Kind) {
    let h = Harness::start(kind).await;
    let mut short = h.permit(&[TOOL]);
    short.lease = Some(atmost_client::duration(Duration::from_secs(3)));
    let p = h.create(short).await.permit_id;
    let tool = FakeTool::default();
    let late = |ms: i64| {
        let clock = h.clock.clone();
        call(&p, &format!("late-{ms}")).on_retry(move |r| {
            if r.rpc == "Authorize" {
                clock.advance(ms);
            }
        })
    };

    let relay = Relay::losing(h.addr, 1).await;
    let lost = relay.client().guarded(late(1_500), tool.hang()).await;
    assert!(relay.struck());
    let Err(GuardError::OutcomeUncertain { reason, .. }) = lost else {
        panic!("expected OutcomeUncertain, got {lost:?}");
    };
    assert_eq!(
        reason,
        "dispatch still running at its deadline, 1s before the lease's end (1.5s left when the answered Authorize try was sent): dropped"
    );
    assert_eq!(tool.sent(), 1);

    let relay = Relay::losing(h.addr, 1).await;
    let none_left = relay.client().guarded(late(2_100), tool.charge()).await;
    assert!(relay.struck());
    assert!(
        matches!(none_left, Err(GuardError::NoTimeToDispatch { .. })),
        "{none_left:?}"
    );
    assert_eq!(tool.sent(), 1, "not called");
    assert_eq!(calls_made(&h, &p).await, 1, "released unsent");
}

/// The lease atmost says is left is counted from when the answered
/// Authorize try was sent, not from when its answer arrived: an answer
/// held on its way back has used that much of the lease. With a 2 s lease
/// (1 s to dispatch in) and the answer held 300 ms, a 900 ms dispatch
/// timeout is cut to what is left, the lease decides; with 1.5 s (500 ms
/// to dispatch in) and the answer held 600 ms, nothing is left: dispatch
/// is not called and the attempt is given back unsent, so nothing goes out
/// past the lease. (A hold is never shorter than asked; a busy machine
/// only makes the answer later, and the first case has 700 ms for that.)
async fn an_answer_slow_to_come_back_leaves_dispatch_only_what_is_left(kind: Kind) {
    let h = Harness::start(kind).await;
    let leased = |lease: Duration| {
        let mut permit = h.permit(&[TOOL]);
        permit.lease = Some(atmost_client::duration(lease));
        h.create(permit)
    };
    let tool = FakeTool::default();

    let p = leased(Duration::from_secs(2)).await.permit_id;
    let relay = Relay::holding(h.addr, Duration::from_millis(300)).await;
    let short = call(&p, "charge-1").dispatch_timeout(Duration::from_millis(900));
    let cut = relay.client().guarded(short, tool.hang()).await;
    assert!(relay.struck(), "the answer was held");
    let Err(GuardError::OutcomeUncertain {
        reason,
        replayed: false,
        ..
    }) = cut
    else {
        panic!("expected OutcomeUncertain, got {cut:?}");
    };
    assert_eq!(
        reason,
        "dispatch still running at its deadline, 1s before the lease's end (2s left when the answered Authorize try was sent): dropped",
        "the lease, not the 900 ms timeout, ended it"
    );
    assert_eq!(tool.sent(), 1);

    let q = leased(Duration::from_millis(1_500)).await.permit_id;
    let relay = Relay::holding(h.addr, Duration::from_millis(600)).await;
    let long = call(&q, "charge-1").dispatch_timeout(Duration::from_secs(5));
    let late = relay.client().guarded(long, tool.charge()).await;
    assert!(relay.struck(), "the answer was held");
    assert!(
        matches!(late, Err(GuardError::NoTimeToDispatch { .. })),
        "{late:?}"
    );
    assert_eq!(tool.sent(), 1, "not called");
    assert_eq!(calls_made(&h, &q).await, 0, "released unsent");
}

/// A retry hook that panics (its log sink gone) is caught and ignored:
/// the retry of a lost answer goes on as if the hook had returned, and the
/// redelivered DISPATCH is sent once.
async fn a_panicking_retry_hook_does_not_stop_the_retry(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 1).await;
    let relay = Relay::losing(h.addr, 1).await;
    let hooked = Arc::new(AtomicUsize::new(0));
    let counted = hooked.clone();
    let tool = FakeTool::default();
    let hook = call(&p, "charge-1").on_retry(move |_| {
        counted.fetch_add(1, Ordering::SeqCst);
        panic!("the log sink is gone");
    });
    let outcome = relay
        .client()
        .guarded(hook, tool.charge())
        .await
        .expect("retried as if the hook had returned");
    assert!(relay.struck(), "the first answer was lost");
    assert_eq!(hooked.load(Ordering::SeqCst), 1);
    assert_eq!(tool.ids(), [outcome.attempt.attempt_id.as_str()]);
    assert_eq!(calls_made(&h, &p).await, 1);
}

/// A dispatch that panics may have sent: the attempt is marked UNCERTAIN,
/// then the panic goes on, to the caller's task. The key replays the
/// unknown and nothing is sent again.
async fn a_panicking_dispatch_is_marked_uncertain_then_resumes(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 2).await;
    let tool = FakeTool::default();
    let (client, sent, guarded) = (h.client.clone(), tool.clone(), call(&p, "charge-1"));
    let run = tokio::spawn(async move {
        client
            .guarded(guarded, move |id| async move {
                sent.record(&id);
                the_tool_client_panics()
            })
            .await
    });
    let panic = run.await.expect_err("the panic resumed").into_panic();
    assert_eq!(
        panic.downcast_ref::<&str>(),
        Some(&"the tool's client panicked")
    );
    let uncertain = h.list_all(&p, 0).await;
    assert_eq!(uncertain.len(), 1, "marked before the panic went on");
    assert_eq!(tool.ids(), [uncertain[0].attempt_id.as_str()]);
    assert_eq!(
        uncertain[0].uncertain_reason,
        "dispatch panicked: the tool's client panicked"
    );
    let again = h.client.guarded(call(&p, "charge-1"), tool.charge()).await;
    assert!(
        matches!(
            &again,
            Err(GuardError::OutcomeUncertain { replayed: true, .. })
        ),
        "{again:?}"
    );
    assert_eq!(tool.sent(), 1, "never sent again");
    assert_eq!(calls_made(&h, &p).await, 1, "the slot stays held");
}

fn the_tool_client_panics() -> Result<Vec<u8>, DispatchError> {
    panic!("the tool's client panicked")
}

/// An actual cost atmost will not take (negative; above the reservation)
/// is refused at Commit and not retried: nothing is recorded, and
/// CommitNotRecorded carries the whole result and atmost's INVALID_REQUEST;
/// the attempt stays RESERVED, to turn UNCERTAIN at its lease.
async fn an_actual_cost_out_of_range_is_not_recorded_and_the_result_kept(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 2).await;
    for (key, cost) in [("charge-1", -1), ("charge-2", 501)] {
        let answer = h
            .client
            .guarded(call(&p, key), move |_| async move {
                Ok::<_, DispatchError>(Dispatched::bytes("wallet tx 981").actual_cost(cost))
            })
            .await;
        let Err(GuardError::CommitNotRecorded {
            attempt_id,
            outcome: Unrecorded::Succeeded { result },
            source,
        }) = answer
        else {
            panic!("{cost}: expected CommitNotRecorded, got {answer:?}");
        };
        assert_eq!(result, b"wallet tx 981", "{cost}");
        assert_eq!(source.reason(), Some(Reason::InvalidRequest), "{source}");
        assert_eq!(source.violated_fields(), ["succeeded.actual_cost"]);
        let attempt = h
            .client
            .get_attempt(&p, key)
            .await
            .expect("read")
            .attempt
            .expect("the attempt");
        // (GetAttempt withholds a RESERVED attempt's id: its fencing token.)
        assert!(!attempt_id.as_str().is_empty());
        assert_eq!(
            attempt.state(),
            pb::AttemptState::Reserved,
            "nothing recorded"
        );
    }
}

/// UNAVAILABLE, then up: the address has no server at the first try; the
/// server starts on that port when the guarded call says it will retry,
/// and the call goes through, dispatching once.
async fn a_server_not_up_yet_is_retried_until_it_is(kind: Kind) {
    let (backend, _redis) = backend(kind);
    let p = seed_permit(&backend, 1).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let (up, start) = oneshot::channel::<()>();
    let up = Mutex::new(Some(up));
    let retries = Arc::new(Mutex::new(Vec::new()));
    let seen = retries.clone();
    let server = tokio::spawn(async move {
        let _ = start.await;
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind the port the client was given");
        Server::on(listener, backend)
    });
    let client = Client::builder(format!("127.0.0.1:{port}"))
        .connect_lazy()
        .expect("a lazy channel");
    let tool = FakeTool::default();
    let outcome = client
        .guarded(
            call(&p, "charge-1").on_retry(move |r| {
                seen.lock()
                    .expect("retries")
                    .push((r.rpc, r.error.code(), r.error.reason()));
                if let Some(up) = up.lock().expect("up").take() {
                    let _ = up.send(());
                }
            }),
            tool.charge(),
        )
        .await
        .expect("through once the server is up");
    let _server = server.await.expect("the server started");
    let retries = retries.lock().expect("retries").clone();
    assert!(!retries.is_empty(), "the first try found no server");
    assert_eq!(
        retries[0],
        ("Authorize", Code::Unavailable, None),
        "a transport failure, retried"
    );
    assert!(!outcome.replayed);
    assert_eq!(tool.sent(), 1);
}

/// An outcome atmost will not take (an operator resolved the attempt
/// while the tool ran): CommitNotRecorded, with the tool's result and
/// atmost's reason, not retried.
async fn an_outcome_atmost_refuses_to_record_says_so(kind: Kind) {
    let h = Harness::start(kind).await;
    let p = permit(&h, 1).await;
    let operator = h.client.clone();
    let result = h
        .client
        .guarded(call(&p, "charge-1"), move |id| async move {
            operator
                .mark_uncertain(pb::MarkUncertainRequest {
                    permit_id: p.clone(),
                    idempotency_key: "charge-1".into(),
                    attempt_id: id.to_string(),
                    reason: "operator".into(),
                })
                .await
                .expect("marked by hand");
            operator
                .resolve(pb::ResolveRequest {
                    permit_id: p.clone(),
                    idempotency_key: "charge-1".into(),
                    attempt_id: String::new(),
                    outcome: Some(resolved_failed("reconciled as failed")),
                })
                .await
                .expect("resolved by hand");
            Ok::<_, DispatchError>(b"wallet tx 981".to_vec())
        })
        .await;
    let Err(GuardError::CommitNotRecorded {
        outcome: Unrecorded::Succeeded { result },
        source,
        ..
    }) = result
    else {
        panic!("expected CommitNotRecorded, got {result:?}");
    };
    assert_eq!(
        result, b"wallet tx 981",
        "the caller keeps the tool's answer"
    );
    assert_eq!(source.reason(), Some(Reason::AttemptStateConflict));
}

/// The server goes away while the tool runs: Commit fails through every
/// try, and the error names the attempt whose outcome is not recorded.
async fn an_outcome_the_server_is_gone_for_says_so(kind: Kind) {
    let (backend, _redis) = backend(kind);
    let p = seed_permit(&backend, 1).await;
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let server = Server::on(listener, backend);
    let client = Client::builder(addr.to_string())
        .connect_lazy()
        .expect("channel");
    let tool = FakeTool::default();
    let recorded = tool.clone();
    let result = client
        .guarded(call(&p, "charge-1"), move |id| async move {
            recorded.record(&id);
            server.stop().await;
            Ok::<_, DispatchError>(b"wallet tx 981".to_vec())
        })
        .await;
    let Err(GuardError::CommitNotRecorded {
        attempt_id,
        outcome: Unrecorded::Succeeded { result },
        source,
    }) = result
    else {
        panic!("expected CommitNotRecorded, got {result:?}");
    };
    assert_eq!(tool.ids(), [attempt_id.to_string()]);
    assert_eq!(result, b"wallet tx 981");
    assert_eq!(source.code(), Code::Unavailable, "{source}");
}

/// A result over 64 KiB: the caller gets it whole, the receipt holds its
/// digest (and a replay answers the digest).
async fn a_result_over_64_kib_is_stored_as_its_digest(kind: Kind) {
    use sha2::{Digest, Sha256};
    let h = Harness::start(kind).await;
    let p = permit(&h, 1).await;
    let big = vec![b'x'; 64 * 1024 + 1];
    let sent = big.clone();
    let outcome = h
        .client
        .guarded(call(&p, "charge-1"), move |_| async move {
            Ok::<_, DispatchError>(sent)
        })
        .await
        .expect("committed");
    let digest: String = Sha256::digest(&big)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(outcome.result, big);
    assert_eq!(
        outcome.receipt.result,
        format!("sha256:{digest}").into_bytes()
    );
    let again = h
        .client
        .guarded(call(&p, "charge-1"), FakeTool::default().charge())
        .await
        .expect("replay");
    assert_eq!(again.result, outcome.receipt.result);
}

// === credentials ===

const ADMIN: &str = "admin-secret-0123456789";
const AGENT: &str = "agent-secret-0123456789";

fn key_file(extra: &str) -> crate::auth::KeyFile {
    crate::auth::KeyFile::new(&format!(
        "{}{}{extra}",
        crate::auth::entry("admin-1", ADMIN, "acme", "\"admin\""),
        crate::auth::entry("agent-1", AGENT, "acme", "\"agent\""),
    ))
}

/// `atmost serve` on `kind`'s store with these flags.
fn serve(kind: Kind, redis: &Option<Redis>, args: &[&str]) -> AtmostProcess {
    let mut all: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    if kind == Kind::Redis {
        all.extend(redis.as_ref().expect("a Redis").serve_args());
    }
    spawn_atmost(&all)
}

/// With `--auth-keys`: the builder's key goes with every call; a wrong
/// key is the typed UNAUTHENTICATED refusal, at once.
async fn a_bearer_key_is_sent_and_a_wrong_one_is_not_retried(kind: Kind) {
    let keys = key_file("");
    let redis = (kind == Kind::Redis).then(Redis::start);
    let server = serve(
        kind,
        &redis,
        &["--auth-keys", keys.path.to_str().expect("utf-8")],
    );
    let addr = server.addr().to_string();
    let admin = Client::builder(&addr)
        .api_key(ADMIN)
        .connect()
        .await
        .expect("admin");
    let p = admin
        .create_permit(NewPermit::new([TOOL]).cap(TOOL, 1))
        .await
        .expect("permit")
        .permit_id;
    let tool = FakeTool::default();

    let retries = Arc::new(AtomicUsize::new(0));
    let counted = retries.clone();
    let stranger = Client::builder(&addr)
        .api_key("not-a-key-atmost-knows")
        .connect()
        .await
        .expect("connects; the key is checked per call");
    let refused = stranger
        .guarded(
            call(&p, "charge-1").on_retry(move |_| {
                counted.fetch_add(1, Ordering::SeqCst);
            }),
            tool.charge(),
        )
        .await;
    let Err(GuardError::Denied(e)) = refused else {
        panic!("expected Denied, got {refused:?}");
    };
    assert_eq!(e.code(), Code::Unauthenticated);
    assert_eq!(e.reason(), Some(Reason::Unauthenticated));
    assert_eq!(retries.load(Ordering::SeqCst), 0, "never retried");
    assert_eq!(tool.sent(), 0);

    let agent = Client::builder(&addr)
        .api_key(AGENT)
        .connect()
        .await
        .expect("agent");
    agent
        .guarded(call(&p, "charge-1"), tool.charge())
        .await
        .expect("the agent's key is accepted");
    assert_eq!(tool.sent(), 1);
    assert!(matches!(
        Client::builder(&addr).api_key("bad\nkey").connect_lazy(),
        Err(atmost_client::ConnectError::InvalidApiKey)
    ));
}

/// TLS with the server's CA (and a key), mTLS with a client certificate
/// the key file maps to an agent (no key), and a client that trusts
/// another CA reaching nothing.
async fn tls_and_mtls(kind: Kind) {
    let pki = Pki::new();
    let server_cert = pki.issue(&["localhost"]);
    let runner = pki.issue(&["spiffe://test/ns/agents/sa/runner"]);
    let keys = key_file(
        "[[cert]]\nid = \"runner\"\nsan = \"spiffe://test/ns/agents/sa/runner\"\ntenant = \"acme\"\nroles = [\"agent\"]\n",
    );
    let file = |name: &str, text: &str| keys.beside(name, text);
    let (cert, key, ca) = (
        file("server.pem", &server_cert.0),
        file("server.key", &server_cert.1),
        file("ca.pem", &pki.ca_pem),
    );
    let redis = (kind == Kind::Redis).then(Redis::start);
    let server = serve(
        kind,
        &redis,
        &[
            "--auth-keys",
            keys.path.to_str().expect("utf-8"),
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--tls-client-ca",
            &ca,
        ],
    );
    let addr = server.addr().to_string();
    let tls = || {
        Client::builder(&addr)
            .tls_ca_pem(&pki.ca_pem)
            .tls_domain_name("localhost")
    };
    let admin = tls().api_key(ADMIN).connect().await.expect("TLS");
    let p = admin
        .create_permit(NewPermit::new([TOOL]))
        .await
        .expect("permit over TLS")
        .permit_id;
    let tool = FakeTool::default();

    let agent = tls().api_key(AGENT).connect().await.expect("TLS");
    agent
        .guarded(call(&p, "charge-1"), tool.charge())
        .await
        .expect("a key over TLS");
    let by_certificate = tls()
        .tls_identity_pem(&runner.0, &runner.1)
        .connect()
        .await
        .expect("mTLS");
    by_certificate
        .guarded(call(&p, "charge-2"), tool.charge())
        .await
        .expect("a certificate stands in for the key");
    assert_eq!(tool.sent(), 2);

    let other_ca = Pki::new();
    let misled = Client::builder(&addr)
        .tls_ca_pem(&other_ca.ca_pem)
        .tls_domain_name("localhost")
        .api_key(AGENT)
        .connect_lazy()
        .expect("lazy");
    let refused = misled
        .guarded(call(&p, "charge-3").max_tries(2), tool.charge())
        .await;
    assert!(
        matches!(&refused, Err(GuardError::Unavailable(e)) if e.reason().is_none()),
        "the handshake fails, nothing is answered: {refused:?}"
    );
    assert_eq!(tool.sent(), 2);
}

// === a lost answer ===

/// What a [`Relay`] does to the `nth` response (counted across
/// connections), at its first DATA frame: after atmost has applied and
/// answered the request.
#[derive(Clone, Copy)]
enum Fault {
    /// Cuts the connection, that frame unsent: the answer is lost.
    Lose,
    /// Holds it, and all the server sends after it, this long: an answer
    /// slow to come back.
    Hold(Duration),
}

/// A loopback relay to the server that does a [`Fault`] to one answer: it
/// reads the server's side as HTTP/2 frames (9 bytes of header: length 3,
/// type 1, flags 1, stream id 4; type 0 is DATA). Every other byte passes
/// unchanged.
struct Relay {
    addr: std::net::SocketAddr,
    struck: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// Loses the `nth` answer.
    async fn losing(upstream: std::net::SocketAddr, nth: usize) -> Self {
        Self::start(upstream, nth, Fault::Lose).await
    }

    /// Holds the first answer `hold` long.
    async fn holding(upstream: std::net::SocketAddr, hold: Duration) -> Self {
        Self::start(upstream, 1, Fault::Hold(hold)).await
    }

    async fn start(upstream: std::net::SocketAddr, nth: usize, fault: Fault) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let struck = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let responses = Arc::new(AtomicUsize::new(0));
        let flag = struck.clone();
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let up = tokio::net::TcpStream::connect(upstream)
                    .await
                    .expect("the server");
                let (responses, flag) = (responses.clone(), flag.clone());
                tokio::spawn(async move {
                    let (mut down_read, down_write) = down.into_split();
                    let (up_read, mut up_write) = up.into_split();
                    let requests = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut down_read, &mut up_write).await;
                    });
                    answers(up_read, down_write, (nth, fault), &responses, &flag).await;
                    requests.abort();
                });
            }
        });
        Self { addr, struck, task }
    }

    fn client(&self) -> Client {
        Client::builder(self.addr.to_string())
            .connect_lazy()
            .expect("a lazy channel")
    }

    /// Whether the fault was done.
    fn struck(&self) -> bool {
        self.struck.load(Ordering::SeqCst)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Server to client, frame by frame; at the `nth` response's first DATA
/// frame, the fault.
async fn answers(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    (nth, fault): (usize, Fault),
    responses: &AtomicUsize,
    struck: &std::sync::atomic::AtomicBool,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut buffer, mut streams) = (Vec::new(), std::collections::HashSet::new());
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        buffer.extend_from_slice(&chunk[..n]);
        let mut whole = 0;
        while buffer.len() - whole >= 9 {
            let frame = &buffer[whole..];
            let size = 9
                + (usize::from(frame[0]) << 16
                    | usize::from(frame[1]) << 8
                    | usize::from(frame[2]));
            if frame.len() < size {
                break;
            }
            let stream = u32::from_be_bytes([frame[5], frame[6], frame[7], frame[8]]) & 0x7fff_ffff;
            if frame[3] == 0
                && stream != 0
                && streams.insert(stream)
                && responses.fetch_add(1, Ordering::SeqCst) + 1 == nth
            {
                let _ = to.write_all(&buffer[..whole]).await;
                struck.store(true, Ordering::SeqCst);
                match fault {
                    Fault::Lose => return,
                    Fault::Hold(hold) => {
                        buffer.drain(..whole);
                        whole = 0;
                        tokio::time::sleep(hold).await;
                    }
                }
            }
            whole += size;
        }
        if to.write_all(&buffer[..whole]).await.is_err() {
            return;
        }
        buffer.drain(..whole);
    }
}

// === a server of the test's own ===

/// A store of `kind`, outside any server, and the Redis it lives in.
fn backend(kind: Kind) -> (Backend, Option<Redis>) {
    match kind {
        Kind::Redis => {
            let redis = Redis::start();
            let store = redis_store(&redis.url, &redis.prefix, Duration::from_secs(2));
            (Backend::Redis(store), Some(redis))
        }
        _ => (
            Backend::Memory(atmost::store::memory::MemoryStore::new(DAY_MS)),
            None,
        ),
    }
}

/// A permit over TOOL with this cap, written straight into `store` (as
/// CreatePermit would) so a server started later serves it.
async fn seed_permit(store: &Backend, cap: u64) -> String {
    let now = atmost_client::now_ms();
    let spec = atmost::api::convert::permit_spec(
        Some(atmost::pb::Permit {
            tools: vec![TOOL.into()],
            max_calls_per_tool: [(TOOL.to_owned(), cap)].into(),
            expires_at: Some(atmost_client::timestamp(now + 3_600_000)),
            ..Default::default()
        }),
        Default::default(),
    )
    .expect("a valid permit");
    let permit = spec
        .into_permit(atmost::domain::new_id(now), now, "")
        .expect("a valid permit");
    store.create_permit(permit).await.expect("stored").permit_id
}

/// The real server on `listener` (system clock), stopped by [`stop`] or
/// with the test's runtime.
///
/// [`stop`]: Server::stop
struct Server {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    fn on(listener: TcpListener, backend: Backend) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            atmost::run(listener, atmost::App::new(backend), async {
                let _ = stopped.await;
            })
            .await
            .expect("server ran");
        });
        Self { stop, task }
    }

    /// Stops it and waits until it no longer serves.
    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.expect("server stopped");
    }
}
