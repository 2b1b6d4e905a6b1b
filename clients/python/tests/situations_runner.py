"""The Python runner of the cross-client test (scripts/cross_client.sh).

Runs each situation of clients/testdata/guarded_situations.json through the
package's public guarded call (``client.call_guarded``; the context manager,
``client.guard``, where the dispatch gives an actual cost, which only
``call.succeeded(result, actual_cost=...)`` takes) and prints one JSON line
per situation: what each call returned or raised, and how many times it ran
dispatch. The harness (examples/cross_client.rs) compares the lines with the
file's expectations and with the Rust and Node runners'. Not a pytest module
(pytest collects test_*.py only); run with the virtualenv clients/python/test.sh
makes::

    python situations_runner.py <guarded_situations.json> <facts.json>

``facts.json``: ``address``, ``api_key``, ``wrong_api_key``,
``unreachable_address``, and ``permits`` (situation name -> the permit id
the harness made for this language).
"""

from __future__ import annotations

import json
import math
import sys
import threading
from typing import Any, Dict, List, Optional

from atmost_client import (
    AtmostError,
    Client,
    CommitNotRecorded,
    Denied,
    HeldByEarlierRun,
    InProgress,
    InvalidRequest,
    NotSent,
    OutcomeUncertain,
    ToolFailed,
    Unavailable,
)

LANGUAGE = "python"

_NON_FINITE = {"$NaN": math.nan, "$Infinity": math.inf, "$-Infinity": -math.inf}


def native(value: Any) -> Any:
    """A parsed JSON value with the markers "$NaN", "$Infinity" and
    "$-Infinity" made the floats they name."""
    if isinstance(value, str):
        return _NON_FINITE.get(value, value)
    if isinstance(value, list):
        return [native(v) for v in value]
    if isinstance(value, dict):
        return {k: native(v) for k, v in value.items()}
    return value


def portable(value: Any) -> Any:
    """``value`` as JSON can print it: bytes as the JSON they hold (else
    their text), a non-finite float as its marker."""
    if isinstance(value, (bytes, bytearray)):
        try:
            return json.loads(bytes(value).decode("utf-8"))
        except ValueError:
            return {"$bytes": bytes(value).decode("utf-8", "replace")}
    if isinstance(value, float) and not math.isfinite(value):
        return "$NaN" if math.isnan(value) else "$Infinity" if value > 0 else "$-Infinity"
    if isinstance(value, (list, tuple)):
        return [portable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): portable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"$python": repr(value)}


def kind(error: BaseException) -> str:
    """The kind's name the situations file uses (the most specific class first)."""
    for cls, name in (
        (CommitNotRecorded, "CommitNotRecorded"),
        (HeldByEarlierRun, "HeldByEarlierRun"),
        (OutcomeUncertain, "OutcomeUncertain"),
        (NotSent, "NotSent"),
        (ToolFailed, "ToolFailed"),
        (InProgress, "InProgress"),
        (Unavailable, "Unavailable"),
        (InvalidRequest, "InvalidRequest"),
        (Denied, "Denied"),
        (AtmostError, "Rpc"),
        (ValueError, "invalid-argument"),
    ):
        if isinstance(error, cls):
            return name
    return f"other:{type(error).__name__}"


def run_call(facts: Dict[str, Any], tool: str, permit_id: str, call: Dict[str, Any]) -> Dict[str, Any]:
    address = facts["unreachable_address"] if call.get("server") == "unreachable" else facts["address"]
    api_key = facts["wrong_api_key"] if call.get("api_key") == "wrong" else facts["api_key"]
    spec: Optional[Dict[str, Any]] = call.get("dispatch")
    dispatched = [0]
    returned: List[Any] = []
    never = threading.Event()

    def result() -> Any:
        value = native(spec["return"]) if spec is not None else {"sent": "by mistake"}
        returned.append(value)
        return value

    def dispatch(attempt_id: str) -> Any:
        dispatched[0] += 1
        if spec is None:
            return result()
        if "refuse" in spec:
            raise ToolFailed(spec["refuse"])
        if spec.get("not_sent"):
            raise NotSent("the runner's dispatch never sent it")
        if "error" in spec:
            raise ConnectionResetError(spec["error"])
        if spec.get("hang"):
            never.wait()
        return result()

    with Client(address, api_key=api_key) as client:
        options = dict(request=native(json.loads(call["request"])), cost=call.get("cost", 0))
        name = call.get("tool", tool)
        try:
            if spec is not None and "actual_cost" in spec:
                with client.guard(permit_id, name, call["key"], **options) as guarded:
                    if guarded.replayed:
                        outcome = guarded.outcome
                    else:
                        dispatched[0] += 1
                        outcome = guarded.succeeded(result(), actual_cost=spec["actual_cost"])
            else:
                outcome = client.call_guarded(permit_id, name, call["key"], dispatch, **options)
        except BaseException as error:  # noqa: BLE001 (every ending is reported)
            return observed_error(error, dispatched[0], returned)
    assert outcome is not None
    return {
        "kind": "none",
        "reason": None,
        "replayed": outcome.replayed,
        "dispatched": dispatched[0],
        "result": portable(outcome.result),
        "as_dispatched": not outcome.replayed and bool(returned) and outcome.result is returned[0],
        "receipt_cost": outcome.receipt.cost,
    }


def observed_error(error: BaseException, dispatched: int, returned: List[Any]) -> Dict[str, Any]:
    reason = getattr(error, "reason", None)
    if isinstance(error, CommitNotRecorded) and reason is None and isinstance(error.__cause__, AtmostError):
        reason = error.__cause__.reason
    seen: Dict[str, Any] = {
        "kind": kind(error),
        "reason": reason,
        "replayed": bool(getattr(error, "replayed", False)),
        "dispatched": dispatched,
        "message": f"{type(error).__name__}: {error}",
    }
    if isinstance(error, ToolFailed):
        seen["failure_reason"] = error.failure_reason
    if isinstance(error, CommitNotRecorded):
        seen["unrecorded"] = str(error.outcome).upper()
        if error.result is not None:
            seen["result"] = portable(error.result)
            seen["as_dispatched"] = bool(returned) and error.result is returned[0]
    return seen


def main(argv: List[str]) -> int:
    if len(argv) != 2:
        print("usage: situations_runner.py <guarded_situations.json> <facts.json>", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as f:
        situations = json.load(f)
    with open(argv[1], encoding="utf-8") as f:
        facts = json.load(f)
    for situation in situations["situations"]:
        if LANGUAGE not in situation.get("languages", [LANGUAGE]):
            continue
        name = situation["name"]
        permit_id = facts["permits"][name]
        calls: List[Dict[str, Any]] = []
        for call in situation["calls"]:
            if calls and calls[-1]["kind"] == "unsupported":
                # The calls after one this language cannot make depend on it.
                calls.append(
                    {"kind": "unsupported", "message": "an earlier call was not made", "dispatched": 0}
                )
            else:
                calls.append(run_call(facts, situations["tool"], permit_id, call))
        print(json.dumps({"situation": name, "language": LANGUAGE, "calls": calls}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
