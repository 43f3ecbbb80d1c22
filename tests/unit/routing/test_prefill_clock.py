"""The prefill clock (routing/prefill_clock.py): the prefill-time fit from requests that found their engine
with nothing to prefill, and each engine's wait, first come first served at the fit's rate."""

from __future__ import annotations

import random

import pytest

from tessera.routing.prefill_clock import (
    FIT_SAMPLES,
    MIN_SAMPLES,
    REFIT_EVERY,
    PrefillClock,
    PrefillFit,
    PrefillWaits,
    fcfs_done_at,
    fit_prefill,
)


def test_the_fit_finds_the_line_through_noisy_delays() -> None:
    rng = random.Random(5)
    samples = [(n, 0.004 + 20e-6 * n + rng.gauss(0, 0.0005)) for n in (rng.randrange(50, 4000) for _ in range(200))]
    fit = fit_prefill(samples)
    assert fit is not None
    assert fit.s_per_token == pytest.approx(20e-6, rel=0.05) and fit.intercept_s == pytest.approx(0.004, abs=0.0005)
    assert fit.seconds(1000) == pytest.approx(0.024, rel=0.03)


def test_too_few_samples_give_no_fit() -> None:
    assert fit_prefill([(100 * i, 0.01 * i) for i in range(1, MIN_SAMPLES)]) is None
    assert fit_prefill([(0, 0.01)] * MIN_SAMPLES) is None  # no tokens at all: no rate


def test_prompts_of_one_length_give_a_rate_through_the_origin() -> None:
    """No spread in the tokens, no slope to fit: the delay is taken as proportional to them."""
    fit = fit_prefill([(350, 0.035), (352, 0.033)] * (MIN_SAMPLES // 2))
    assert fit is not None and fit.intercept_s == 0.0 and fit.s_per_token == pytest.approx(0.034 / 351)


def test_a_line_sloping_down_or_crossing_below_zero_falls_back_to_the_rate_through_the_origin() -> None:
    down = fit_prefill([(n, 0.05 - 1e-5 * n) for n in range(100, 100 + 40 * MIN_SAMPLES, 40)])
    assert down is not None and down.intercept_s == 0.0 and down.s_per_token > 0
    steep = fit_prefill([(n, max(0.0, 1e-4 * n - 0.01)) for n in range(200, 200 + 40 * MIN_SAMPLES, 40)])
    assert steep is not None and steep.intercept_s == 0.0 and steep.s_per_token > 0


def test_fcfs_each_starts_when_dispatched_or_when_the_one_before_it_is_done() -> None:
    fit = PrefillFit(0.0, 0.001)  # 1 ms a token
    assert fcfs_done_at([], fit) == 0.0
    # 10 tokens at t=0 end at 0.010; 5 tokens dispatched at 0.002 wait for them and end at 0.015; 5 more
    # dispatched at 0.100, after the queue emptied, end at 0.105.
    assert fcfs_done_at([(0.0, 10), (0.002, 5)], fit) == pytest.approx(0.015)
    assert fcfs_done_at([(0.0, 10), (0.002, 5), (0.100, 5)], fit) == pytest.approx(0.105)


def learned(clock: PrefillClock, engine_id: str = "warm", per_token: float = 1e-4) -> None:
    """Feeds ``clock`` isolated requests of several lengths, delay ``per_token`` a token, until it has a fit."""
    now = 0.0
    for i in range(MIN_SAMPLES):
        tokens = 100 + 50 * i
        ticket = clock.dispatch(engine_id, tokens, now, isolated=True)
        now += per_token * tokens
        clock.first_token(engine_id, ticket, now)
        now += 1.0


def test_the_clock_learns_only_from_isolated_requests_and_then_reports_waits() -> None:
    clock = PrefillClock()
    for i in range(3 * MIN_SAMPLES):  # queued behind others: their delays are not their prefill's
        ticket = clock.dispatch("busy", 100 + i, 0.0, isolated=False)
        clock.first_token("busy", ticket, 5.0)
    assert clock.fit is None and clock.waits(0.0) == {}
    clock.dispatch("a", 1000, 100.0, isolated=False)
    assert clock.done_at("a") == 0.0 and clock.waits(100.0) == {}  # no fit: no wait to report
    learned(clock)
    assert clock.fit is not None and clock.fit.s_per_token == pytest.approx(1e-4)
    # The fit reaches what was already queued with the next event at that engine.
    second = clock.dispatch("a", 500, 100.01, isolated=False)
    assert clock.done_at("a") == pytest.approx(100.0 + 0.1 + 0.05)
    assert clock.waits(100.05) == pytest.approx({"a": 0.1})
    clock.first_token("a", second, 100.06)
    # The remaining prompt counts from its own dispatch.
    assert clock.waits(100.05) == pytest.approx({"a": 0.05})
    assert clock.waits(200.0) == {}  # overdue: no wait, never a negative one


def test_the_last_prompt_prefilled_leaves_the_engine_idle_and_an_unknown_ticket_changes_nothing() -> None:
    clock = PrefillClock()
    learned(clock)
    ticket = clock.dispatch("a", 200, 50.0, isolated=True)
    assert not clock.idle("a")
    clock.first_token("a", ticket + 99, 50.01)
    assert clock.done_at("a") == pytest.approx(50.02)
    clock.first_token("a", ticket, 50.01)
    assert clock.idle("a") and clock.done_at("a") == 0.0 and clock.waits(50.0) == {}
    clock.first_token("a", ticket, 50.02)  # twice (prefilled, then the request's end): once counted


def test_the_fit_follows_the_engine_over_its_window() -> None:
    """A slower engine (a new model, a busier node) shows in the fit within a window of samples."""
    clock = PrefillClock()
    learned(clock, per_token=1e-4)
    learned(clock, per_token=3e-4)  # MIN_SAMPLES more: refitted every REFIT_EVERY
    assert MIN_SAMPLES % REFIT_EVERY == 0 and clock.fit is not None
    assert 1e-4 < clock.fit.s_per_token < 3e-4
    for _ in range(FIT_SAMPLES // MIN_SAMPLES):
        learned(clock, per_token=3e-4)
    assert clock.fit.s_per_token == pytest.approx(3e-4)


def test_a_request_that_ended_without_a_first_token_leaves_the_queue_and_teaches_nothing() -> None:
    clock = PrefillClock()
    for i in range(MIN_SAMPLES - 1):
        clock.first_token("a", clock.dispatch("a", 100 + 10 * i, float(i), isolated=True), i + 0.01)
    refused = clock.dispatch("a", 4000, 100.0, isolated=True)
    clock.drop("a", refused)  # a 503, a timeout: its time is no prefill's
    assert clock.idle("a") and clock.fit is None
    clock.first_token("a", clock.dispatch("a", 300, 200.0, isolated=True), 200.03)
    assert clock.fit is not None


def test_the_waits_are_read_on_demand_from_the_finish_times() -> None:
    """A decision looks up the engines it ranks; the view computes those, and iterating it gives the same."""
    waits = PrefillWaits({"a": 10.5, "b": 9.0, "c": 12.0}, now=10.0)
    assert waits.get("a") == pytest.approx(0.5) and waits.get("b") == 0.0 and waits.get("z", -1.0) == -1.0
    assert waits["c"] == pytest.approx(2.0) and "b" not in waits  # overdue: no wait
    assert dict(waits) == pytest.approx({"a": 0.5, "c": 2.0}) and len(waits) == 2
