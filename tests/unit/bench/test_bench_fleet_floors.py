"""bench-fleet's TTFT floors (bench/fleet/floors.py): a request alone on an idle replica, priced by the sim's own
step-time model, with nothing cached and with the ideal cache."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from fleet.floors import idle_prefill_s, ttft_floors

from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.scheduler import StepShape
from tessera.engine.sim.step_time import step_time_fn

STEP_S, TOKEN_S, PAIR_S = 0.002, 1e-5, 1e-9


def linear_step(shape: StepShape) -> float:
    return STEP_S + TOKEN_S * shape.num_scheduled_tokens + PAIR_S * shape.attention_pairs


def test_an_uncached_prompt_is_its_chunks_steps() -> None:
    # 2,500 tokens at a budget of 1,000: chunks of 1,000, 1,000 and 500, each attending to what came before.
    pairs = 1000 * (0 + 1001 / 2) + 1000 * (1000 + 1001 / 2) + 500 * (2000 + 501 / 2)
    assert idle_prefill_s(2500, 0, linear_step, 1000) == pytest.approx(3 * STEP_S + 2500 * TOKEN_S + pairs * PAIR_S)


def test_cached_tokens_are_not_computed_but_are_attended_to() -> None:
    pairs = 100 * (2400 + 101 / 2)
    assert idle_prefill_s(2500, 2400, linear_step, 1000) == pytest.approx(STEP_S + 100 * TOKEN_S + pairs * PAIR_S)
    assert idle_prefill_s(2500, 2400, linear_step, 1000) < idle_prefill_s(2500, 0, linear_step, 1000)


def test_the_last_prompt_token_is_always_computed() -> None:
    whole = idle_prefill_s(64, 64, linear_step, 1000)
    assert whole == idle_prefill_s(64, 63, linear_step, 1000)
    assert whole == pytest.approx(STEP_S + TOKEN_S + 1 * (63 + 1) * PAIR_S)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="prompt token"):
        idle_prefill_s(0, 0, linear_step, 1000)
    with pytest.raises(ValueError, match="token_budget"):
        idle_prefill_s(10, 0, linear_step, 0)
    with pytest.raises(ValueError, match="one ideal cached count per request"):
        ttft_floors([10, 20], [0], linear_step, 1000)


def test_floors_of_a_workload_whose_tail_shares_nothing() -> None:
    # 90 requests that share a 2,000-token prefix (all but the first cached ideally) and 10 long prompts that
    # share nothing: the ideal cache shortens the median, not the tail, so the best ratio stays near 1.
    prompts = [2016] * 90 + [3000] * 10
    ideal = [0] + [2000] * 89 + [0] * 10
    floors = ttft_floors(prompts, ideal, linear_step, 8192)
    assert floors.ideal_p50_s < floors.uncached_p50_s / 5
    assert floors.ideal_p99_s == pytest.approx(floors.uncached_p99_s)
    assert floors.best_p99_ratio == pytest.approx(1.0)


def test_floors_of_a_workload_whose_tail_is_cacheable() -> None:
    prompts = [2016] * 100
    ideal = [0] + [2000] * 99
    floors = ttft_floors(prompts, ideal, linear_step, 8192)
    assert floors.best_p99_ratio < 0.5


def test_the_sims_roofline_gives_tens_of_ms_for_a_few_thousand_tokens() -> None:
    # The fleet's replica (H100 SXM, Llama-3-70B TP8): a 3,000-token prefill is compute-bound, tens of ms; a
    # 16-token remainder over a 3,000-token cached context is one step near the weight-read floor.
    replica = SimEngineConfig()
    step = step_time_fn(replica.step_time)
    cold = idle_prefill_s(3000, 0, step, replica.max_num_batched_tokens)
    warm = idle_prefill_s(3016, 3000, step, replica.max_num_batched_tokens)
    assert 0.02 < cold < 0.5
    assert warm < cold / 5
