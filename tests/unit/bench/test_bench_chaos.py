"""The chaos run's kill schedule, request classification and billing check (bench/longrun/chaos.py): pure,
no process started."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from longrun.chaos import FAILED, LOST, SUCCEEDED, TARGETS, Kill, Outcome, bill, classify, schedule


def outcome(ok: bool = True, kind: str | None = None, status: int | None = 200, received: int = 32,
            send: float = 10.0, done: float = 12.0) -> Outcome:
    return Outcome(ok=ok, error_kind=kind, http_status=status, t_send_s=send, t_done_s=done,
                   tokens_received=received, max_tokens=32)


def test_schedule_is_seeded_one_kill_per_target_inside_the_run_and_spaced() -> None:
    kills = schedule(7, 120.0)
    assert kills == schedule(7, 120.0)
    assert sorted(k.target for k in kills) == sorted(TARGETS)
    times = [k.at_s for k in kills]
    assert times == sorted(times)
    assert all(0.1 * 120 <= t <= 0.8 * 120 for t in times)
    assert all(b - a >= 120 / (2 * len(TARGETS)) - 1e-9 for a, b in itertools.pairwise(times))
    assert {tuple(k.target for k in schedule(s, 120.0)) for s in range(20)} != {tuple(TARGETS)}  # order varies


def test_schedule_leaves_a_slow_targets_recovery_before_the_next_kill_when_it_fits() -> None:
    for seed in range(20):
        kills = schedule(seed, 300.0, recovery_s={"engine": 75.0})
        after = [b.at_s - a.at_s for a, b in itertools.pairwise(kills) if a.target == "engine"]
        assert all(gap >= 75.0 for gap in after)
    # 120 s cannot hold a 75 s gap besides a 20 s one inside its 84 s window: the plain gaps then.
    assert schedule(3, 120.0, recovery_s={"engine": 75.0}) == schedule(3, 120.0)


def test_schedule_rejects_an_empty_run() -> None:
    with pytest.raises(ValueError):
        schedule(0, 0.0)


@pytest.mark.parametrize(("given", "expected"), [
    (outcome(), (SUCCEEDED, "complete")),
    (outcome(received=20), (LOST, "short_stream")),  # ended cleanly, short of max_tokens, no error event
    (outcome(False, "http_503", 503, 0), (FAILED, "http_503")),
    (outcome(False, "stream_error", 200, 5), (FAILED, "stream_error")),
    (outcome(False, "connect", None, 0), (FAILED, "connect")),
    (outcome(False, "broken_stream", None, 0), (FAILED, "closed_before_response")),
    (outcome(False, "broken_stream", 200, 7), (FAILED, "cut_mid_body")),  # cut inside the chunked body
    (outcome(False, "timeout", 200, 3), (LOST, "hang")),
    (outcome(False, "incomplete", None, 0), (LOST, "hang")),
    (outcome(False, "empty_output", 200, 0), (LOST, "empty_output")),
])
def test_classify(given: Outcome, expected: tuple[str, str]) -> None:
    got = classify(given)
    assert (got.outcome, got.reason) == expected


def test_a_request_is_attributed_to_the_latest_outage_it_overlaps() -> None:
    kills = [Kill(5.0, "redis", 2.0), Kill(11.0, "engine", 60.0), Kill(11.5, "gateway", 3.0), Kill(90.0, "redis")]
    assert classify(outcome(False, "broken_stream", 200, 3, send=10.0, done=12.0), kills).killed == "gateway"
    assert classify(outcome(False, "http_503", 503, 0, send=20.0, done=21.0), kills).killed == "engine"
    assert classify(outcome(False, "http_503", 503, 0, send=7.5, done=8.0), kills).killed is None
    assert classify(outcome(False, "http_503", 503, 0, send=7.0, done=7.1), kills).killed == "redis"  # edge


def test_bill_allows_undelivered_tokens_of_requests_that_did_not_succeed() -> None:
    outcomes = [outcome(), outcome(), outcome(False, "broken_stream", 200, 10), outcome(False, "http_503", 503, 0)]
    served = 32 + 32 + 10
    bound = (32 - 10) + 32
    exact = bill("t", outcomes, charged_tokens=served + bound, charged_requests=4)
    assert (exact.served_tokens, exact.bound_tokens, exact.double_billed_tokens, exact.unbilled_tokens) == \
        (served, bound, 0, 0)
    over = bill("t", outcomes, charged_tokens=served + bound + 1, charged_requests=4)
    assert over.double_billed_tokens == 1
    under = bill("t", outcomes, charged_tokens=served - 5, charged_requests=2)
    assert (under.double_billed_tokens, under.unbilled_tokens) == (0, 5)
