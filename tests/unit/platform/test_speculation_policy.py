"""The speculation policy on exact cases, and its controller against a fake engine (no vLLM)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tessera.engine.protocol import RequestStats
from tessera.engine.speculation_control import SET_K_METHOD, SpeculationControl, request_sample
from tessera.engine.speculation_policy import (
    AcceptanceWindow,
    PolicySettings,
    SpeculationState,
    StepCost,
    decide,
    estimate,
    gain,
    per_token_acceptance,
)
from tessera.planner.serving import expected_tokens_per_step

CHEAP = StepCost(((1 << 30, 0.1),), proposer_cost_per_step=0.05)
SETTINGS = PolicySettings(min_decode_steps=100, off_margin=0.03, on_margin=0.03, switch_margin=0.05,
                          probe_interval_s=60.0)
ON3 = SpeculationState("on", 3, since_s=0.0)
# α = 0.8 exactly at k = 3: a full draft accepts 0.8 + 0.64 + 0.512 = 1.952 tokens on average.
REPETITIVE = AcceptanceWindow(num_decode_steps=1000, num_draft_tokens=3000, num_accepted_tokens=1952,
                              num_speculative_tokens=3)
NOISE = AcceptanceWindow(num_decode_steps=1000, num_draft_tokens=0, num_accepted_tokens=0, num_speculative_tokens=3)


# ---- the fit ------------------------------------------------------------------------------------------------

def test_alpha_inverts_the_planners_formula() -> None:
    assert per_token_acceptance(0.0, 3) == 0.0
    assert per_token_acceptance(3.0, 3) == 1.0
    assert per_token_acceptance(1.952, 3) == pytest.approx(0.8, abs=1e-12)
    for alpha in (0.1, 0.5, 0.9):
        assert per_token_acceptance(expected_tokens_per_step(alpha, 4) - 1.0, 4) == pytest.approx(alpha, abs=1e-12)
    with pytest.raises(ValueError):
        per_token_acceptance(3.5, 3)
    with pytest.raises(ValueError):
        per_token_acceptance(1.0, 0)


def test_window_rates_and_validation() -> None:
    window = AcceptanceWindow(num_decode_steps=100, num_draft_tokens=150, num_accepted_tokens=90,
                              num_speculative_tokens=3)
    assert window.acceptance_rate == 0.6
    assert window.drafting_share == 0.5
    assert (window + window) == AcceptanceWindow(200, 300, 180, 3)
    with pytest.raises(ValueError, match="exceeds drafted"):
        AcceptanceWindow(10, 5, 6, 3)
    with pytest.raises(ValueError, match="different k"):
        _ = window + AcceptanceWindow(10, 5, 1, 2)


def test_vllms_acceptance_rate_is_below_alpha() -> None:
    est = estimate(REPETITIVE, num_running=1, max_k=3, cost=CHEAP)
    assert est.acceptance_rate == pytest.approx(1952 / 3000)
    assert est.alpha == pytest.approx(0.8, abs=1e-12)
    assert est.expected_tokens_per_step == pytest.approx(2.952)


def test_verify_cost_is_piecewise_by_batch() -> None:
    cost = StepCost(((4, 0.0), (16, 0.5), (64, 1.0)))
    assert [cost.verify_cost(b) for b in (1, 4, 5, 16, 17, 64, 1000)] == [0.0, 0.0, 0.5, 0.5, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="strictly increasing"):
        StepCost(((16, 0.5), (4, 0.0)))
    with pytest.raises(ValueError, match=">= 0"):
        StepCost(((4, -0.1),))


# ---- gain and break-even --------------------------------------------------------------------------------

def test_gain_exact_values() -> None:
    assert gain(0.5, 1.0, 1, verify_cost=0.0, proposer_cost=0.0) == 1.5  # E(0.5, 1) = 1.5, free verification
    assert gain(0.5, 1.0, 1, verify_cost=0.5, proposer_cost=0.0) == 1.0  # 1.5 tokens for 1.5 steps
    assert gain(0.9, 0.7, 0, verify_cost=0.5, proposer_cost=0.2) == 1.0  # off: one token per step
    assert gain(0.0, 0.0, 3, verify_cost=0.1, proposer_cost=0.05) == 1 / 1.05  # drafts nothing, pays p


def test_break_even_is_where_the_gain_is_one() -> None:
    # Break-even E(α, k) = 1 + c·k + p/q: with c = 0.25, p = 0.1, q = 0.5, k = 2 that is E = 1.7.
    cost = StepCost(((1 << 30, 0.25),), proposer_cost_per_step=0.1)
    alpha = per_token_acceptance(0.7, 2)  # E(α, 2) = 1.7: 0.7 accepted per full draft (350·2 / 1000)
    window = AcceptanceWindow(num_decode_steps=1000, num_draft_tokens=1000, num_accepted_tokens=350,
                              num_speculative_tokens=2)
    est = estimate(window, num_running=1, max_k=2, cost=cost)
    assert est.drafting_share == 0.5 and est.alpha == pytest.approx(alpha)
    assert est.break_even_tokens_per_step == pytest.approx(1.7)
    assert est.expected_tokens_per_step == pytest.approx(1.7)
    assert est.gain == pytest.approx(1.0)
    assert estimate(NOISE, 1, 3, CHEAP).break_even_tokens_per_step == math.inf


# ---- decisions --------------------------------------------------------------------------------------------

def test_too_few_steps_decides_nothing() -> None:
    small = AcceptanceWindow(99, 0, 0, 3)
    decision = decide(ON3, small, 1, 3, CHEAP, SETTINGS, now_s=10.0)
    assert decision.state == ON3 and not decision.changed and "99 of 100" in decision.reason


def test_a_drafter_that_drafts_nothing_is_turned_off() -> None:
    decision = decide(ON3, NOISE, 1, 3, CHEAP, SETTINGS, now_s=10.0)  # gain 1/1.05 = 0.952 < 0.97
    assert decision.changed
    assert decision.state == SpeculationState("off", 0, since_s=10.0, alpha=0.0, drafting_share=0.0)


def test_hysteresis_band_keeps_the_state() -> None:
    cheap_proposer = StepCost(((1 << 30, 0.1),), proposer_cost_per_step=0.02)  # gain 1/1.02 = 0.980 >= 0.97
    decision = decide(ON3, NOISE, 1, 3, cheap_proposer, SETTINGS, now_s=10.0)
    assert not decision.changed and decision.state.phase == "on" and decision.state.num_speculative_tokens == 3


def test_high_acceptance_stays_on_at_the_best_k() -> None:
    # gains at c = 0.1, p = 0.05: k=1 1.8/1.15, k=2 2.44/1.25, k=3 2.952/1.35 = 2.187 (best)
    decision = decide(ON3, REPETITIVE, 1, 3, CHEAP, SETTINGS, now_s=10.0)
    assert not decision.changed and decision.state.num_speculative_tokens == 3
    assert decision.estimate is not None and decision.estimate.best_gain == pytest.approx(2.952 / 1.35)
    assert decision.state.alpha == pytest.approx(0.8)


def test_k_changes_only_beyond_the_switch_margin() -> None:
    # c = 0.5: k=3 2.952/2.55 = 1.1576, k=2 2.44/2.05 = 1.1902 (best), k=1 1.8/1.55 = 1.1613
    dear = StepCost(((1 << 30, 0.5),), proposer_cost_per_step=0.05)
    kept = decide(ON3, REPETITIVE, 1, 3, dear, SETTINGS, now_s=10.0)  # 1.1902 < 1.1576·1.05
    assert not kept.changed and kept.state.num_speculative_tokens == 3
    narrow = PolicySettings(min_decode_steps=100, switch_margin=0.02)  # 1.1902 >= 1.1576·1.02
    turned = decide(ON3, REPETITIVE, 1, 3, dear, narrow, now_s=10.0)
    assert turned.changed and turned.state == SpeculationState("on", 2, 10.0, turned.state.alpha, 1.0)


def test_a_large_batch_turns_it_off_and_a_small_one_back_on() -> None:
    by_batch = StepCost(((8, 0.1), (1 << 30, 1.0)), proposer_cost_per_step=0.05)
    assert not decide(ON3, REPETITIVE, 4, 3, by_batch, SETTINGS, now_s=10.0).changed
    # batch 64, c = 1: k=1 1.8/2.05 = 0.878 is the best and below 0.97
    off = decide(ON3, REPETITIVE, 64, 3, by_batch, SETTINGS, now_s=10.0)
    assert off.changed and off.state.phase == "off" and off.state.alpha == pytest.approx(0.8)
    empty = AcceptanceWindow()
    assert not decide(off.state, empty, 64, 3, by_batch, SETTINGS, now_s=20.0).changed
    probe = decide(off.state, empty, 4, 3, by_batch, SETTINGS, now_s=20.0)  # the last fit pays at batch 4
    assert probe.changed and probe.state == SpeculationState("probe", 3, 20.0, off.state.alpha, 1.0)


def test_off_probes_after_the_interval_and_the_probe_decides() -> None:
    off = SpeculationState("off", 0, since_s=0.0, alpha=0.0, drafting_share=0.0)
    assert not decide(off, AcceptanceWindow(), 1, 3, CHEAP, SETTINGS, now_s=59.9).changed
    probe = decide(off, AcceptanceWindow(), 1, 3, CHEAP, SETTINGS, now_s=60.0)
    assert probe.changed and probe.state.phase == "probe" and probe.state.num_speculative_tokens == 3
    again_off = decide(probe.state, NOISE, 1, 3, CHEAP, SETTINGS, now_s=70.0)
    assert again_off.changed and again_off.state.phase == "off" and again_off.state.since_s == 70.0
    on = decide(probe.state, REPETITIVE, 1, 3, CHEAP, SETTINGS, now_s=70.0)
    assert on.changed and on.state.phase == "on" and on.state.num_speculative_tokens == 3


def test_state_invariant() -> None:
    with pytest.raises(AssertionError):
        SpeculationState("off", 3, 0.0)
    with pytest.raises(AssertionError):
        SpeculationState("on", 0, 0.0)


# ---- the controller -------------------------------------------------------------------------------------

class FakeEngine:
    """What the controller uses of AsyncLLM: collective_rpc, answered as one worker would."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple[Any, ...] = (),
                             kwargs: dict[str, Any] | None = None) -> list[Any]:
        self.calls.append((method, args))
        return [args[0]]


def finished(out: int, drafted: int, accepted: int, arrival_ts: float = 100.0) -> RequestStats:
    return RequestStats(num_output_tokens=out, num_spec_draft_tokens=drafted, num_spec_accepted_tokens=accepted,
                        arrival_ts=arrival_ts)


def test_request_sample() -> None:
    assert request_sample(finished(48, 30, 20)) == (27, 30, 20)  # 48 − 1 (prefill) − 20 accepted
    assert request_sample(finished(48, 0, 0)) == (47, 0, 0)
    assert request_sample(finished(48, 0, 5)) is None  # n > 1: no per-request counts
    assert request_sample(finished(1, 0, 0)) is None  # no decode step


async def test_controller_turns_off_then_ignores_requests_until_the_probe() -> None:
    wall = [1000.0]
    control = SpeculationControl("ngram", 3, settings=SETTINGS, cost=CHEAP, window_requests=4,
                                 clock=lambda: 5.0, wall_clock=lambda: wall[0])
    engine = FakeEngine()
    for _ in range(3):
        control.observe(finished(48, 0, 0), "t1")
    assert control.engine_window.steps == 141
    decision = await control.maybe_apply(engine, num_running=2)
    assert decision.changed and control.state.phase == "off"
    assert engine.calls == [(SET_K_METHOD, (0,))]
    assert control.engine_window.steps == 0 and control.tenant_windows["t1"].steps == 0
    control.observe(finished(48, 0, 0, arrival_ts=2000.0), "t1")  # off: nothing is measured
    assert control.engine_window.steps == 0
    facts = control.facts()
    assert facts["phase"] == "off" and facts["num_speculative_tokens"] == 0 and facts["num_switches"] == 1
    text = control.prometheus_text("e1", "m").decode()
    assert 'tessera_engine_speculation_on{engine_id="e1",model="m"} 0.0' in text
    assert 'tessera_engine_speculation_switches_total{engine_id="e1",model="m"} 1.0' in text


async def test_controller_window_slides_and_drops_requests_from_before_a_switch() -> None:
    control = SpeculationControl("ngram", 3, settings=SETTINGS, cost=CHEAP, window_requests=2,
                                 wall_clock=lambda: 500.0)
    for accepted in (10, 20, 30):
        control.observe(finished(60, 40, accepted), "t1")
    assert (control.engine_window.steps, control.engine_window.drafted, control.engine_window.accepted) == (
        (59 - 20) + (59 - 30), 80, 50)
    control._window_start_wall_s = 500.0  # as after a switch at wall time 500
    control.observe(finished(60, 40, 10, arrival_ts=499.0), "t1")
    assert control.engine_window.accepted == 50


async def test_methods_without_a_runtime_switch_only_advise() -> None:
    control = SpeculationControl("eagle", 3, settings=SETTINGS, cost=CHEAP)
    engine = FakeEngine()
    for _ in range(3):
        control.observe(finished(48, 0, 0), "t1")
    decision = await control.maybe_apply(engine, num_running=1)
    assert decision.changed and control.state.phase == "off" and engine.calls == []
    assert control.facts()["runtime_toggle"] is False


def test_tenants_are_bounded_least_recent_first() -> None:
    control = SpeculationControl("ngram", 3, max_tenants=2)
    for tenant in ("a", "b", "a", "c"):
        control.observe(finished(48, 30, 20), tenant)
    assert list(control.tenant_windows) == ["a", "c"]
    facts = control.facts()["tenants"]["a"]
    assert facts["num_requests"] == 2 and facts["best_num_speculative_tokens"] >= 1
