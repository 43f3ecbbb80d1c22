"""Fitting the measured step-time model on a real engine's step timings (step_time_fit.py)."""

from __future__ import annotations

import random

import pytest

from tessera.engine.sim.step_time import MeasuredStepTime, measured_step_time
from tessera.engine.sim.step_time_fit import (
    StepSample,
    attention_work,
    fit_measured_step_time,
    jitter_factors,
    jitter_seconds,
    relative_errors,
)

TRUE = MeasuredStepTime(step_s=0.004, per_seq_s=0.0004, per_prefill_token_s=0.00002, per_prefill_seq_s=0.0015,
                        per_attention_pair_s=2e-9, per_context_token_s=3e-7)


def sample(num_decode: int, prompts: list[int], noise: float = 0.0, rng: random.Random | None = None,
           decode_context: int = 40) -> StepSample:
    """A step of ``num_decode`` sequences decoding at ``decode_context`` tokens each and uncached ``prompts``."""
    pairs = sum(n * (n + 1) / 2 for n in prompts) + num_decode * (decode_context + 1.0)
    context = sum(prompts) + num_decode * (decode_context + 1)
    shape = StepSample(0.0, num_decode + len(prompts), len(prompts), sum(prompts), pairs, context).shape()
    duration = measured_step_time(TRUE)(shape) * (1 + (rng.uniform(-noise, noise) if rng else 0.0))
    return StepSample(duration, num_decode + len(prompts), len(prompts), sum(prompts), pairs, context)


def probe_steps(rng: random.Random | None = None, noise: float = 0.0) -> list[StepSample]:
    steps = []
    for _ in range(5):
        steps += [sample(b, [], noise, rng, decode_context=c) for b in (1, 2, 4, 8) for c in (40, 400, 1200)]
        steps += [sample(1, [n], noise, rng) for n in (32, 128, 512, 1024, 1536)]
        steps += [sample(0, [16] * k, noise, rng) for k in (1, 2, 3)]
    return steps


def test_exact_steps_give_back_the_model_that_made_them() -> None:
    fitted = fit_measured_step_time(probe_steps())
    for name in ("step_s", "per_seq_s", "per_prefill_token_s", "per_prefill_seq_s", "per_attention_pair_s",
                 "per_context_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-12)


def test_decode_steps_at_several_contexts_part_the_per_sequence_cost_from_the_context_cost() -> None:
    # What the calibration probes do: decode batches at short and long contexts. Fitted without the context
    # term, the per-sequence cost averages the contexts and the short-context steps come out too slow.
    steps = probe_steps()
    without = fit_measured_step_time(steps, terms=("step_s", "per_seq_s", "per_prefill_token_s",
                                                   "per_prefill_seq_s", "per_attention_pair_s"))
    short = [sample(8, [], decode_context=40)]
    assert relative_errors(fit_measured_step_time(steps), short)[0] == pytest.approx(0.0, abs=1e-6)
    assert relative_errors(without, short)[0] > 0.02


def test_medians_per_shape_shrug_off_a_few_slow_outliers() -> None:
    rng = random.Random(1)
    steps = probe_steps(rng, noise=0.02)
    # A neighbour's burst: one in ten decode steps ten times slower.
    steps += [StepSample(0.05, 2, 0, 0, 80.0) for _ in range(2)]
    fitted = fit_measured_step_time(steps)
    assert fitted.step_s == pytest.approx(TRUE.step_s, rel=0.1)
    assert fitted.per_prefill_token_s == pytest.approx(TRUE.per_prefill_token_s, rel=0.1)
    errors = relative_errors(fitted, probe_steps())
    assert max(abs(e) for e in errors) < 0.05


def test_a_term_the_data_contradicts_is_dropped_not_negative() -> None:
    # Prefill steps cheaper per sequence than the decode line predicts: the mix term would come out negative.
    steps = [StepSample(0.004 + 0.0004 * (b - 1), b, 0, 0, 0.0) for b in (1, 2, 4, 8)]
    steps += [StepSample(0.004 + 0.00002 * n - 0.001, 2, 1, n, 0.0) for n in (64, 256, 1024)]
    fitted = fit_measured_step_time(steps, terms=("step_s", "per_seq_s", "per_prefill_token_s", "per_prefill_seq_s"))
    assert fitted.per_prefill_seq_s == 0.0
    assert fitted.per_seq_s >= 0.0 and fitted.per_prefill_token_s > 0.0


def test_only_the_chosen_terms_are_fitted() -> None:
    fitted = fit_measured_step_time(probe_steps(), terms=("step_s", "per_seq_s", "per_prefill_token_s"))
    assert (fitted.per_prefill_seq_s, fitted.per_attention_pair_s, fitted.per_context_token_s) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="per_seq_s"):
        fit_measured_step_time(probe_steps(), terms=("step_s", "per_token"))
    with pytest.raises(ValueError, match="no step samples"):
        fit_measured_step_time([])


def test_jitter_seconds_are_the_measured_minus_modelled_quantiles() -> None:
    # Interruptions add time whatever the step computes: a decode and a long prefill, each 2 ms late once.
    config = MeasuredStepTime(step_s=0.004, per_seq_s=0.0, per_prefill_token_s=0.00004)
    steps = [StepSample(0.004, 1, 0, 0, 0.0)] * 3 + [StepSample(0.006, 1, 0, 0, 0.0)]
    steps += [StepSample(0.044, 1, 1, 1000, 0.0)] * 3 + [StepSample(0.046, 1, 1, 1000, 0.0)]
    assert jitter_seconds(config, steps, num_quantiles=5) == pytest.approx((0.0, 0.0, 0.0, 0.0005, 0.002))
    with pytest.raises(ValueError, match="jitter"):
        jitter_seconds(config, [], num_quantiles=5)


def test_the_drawn_jitter_keeps_the_samples_tail_where_one_outlier_stands_far_out() -> None:
    # 99 % of steps on time, 0.9 % 2 ms late, one in 1,000 100 ms late: the draws' p99.5 is the samples' 2 ms, not
    # half way to the one outlier (which interpolating between 101 quantiles gave: the last 1 % of draws spread
    # evenly from q99 to the largest sample made the sim's ITL p99 30-45 % long; docs/routing.md).
    config = MeasuredStepTime(step_s=0.004, per_seq_s=0.0, per_prefill_token_s=0.0)
    late = {**{i: 0.002 for i in range(990, 999)}, 999: 0.1}
    steps = [StepSample(0.004 + late.get(i % 1000, 0.0), 1, 0, 0, 0.0) for i in range(10_000)]
    jittered = MeasuredStepTime(step_s=0.004, per_seq_s=0.0, per_prefill_token_s=0.0,
                                jitter_s=jitter_seconds(config, steps), jitter_seed=3)
    step_time = measured_step_time(jittered)
    shape = steps[0].shape()
    draws = sorted(step_time(shape) - 0.004 for _ in range(100_000))
    assert draws[99_500] == pytest.approx(0.002, abs=1e-4)
    assert draws[90_000] == pytest.approx(0.0, abs=1e-6)
    assert max(draws) <= 0.1 + 1e-9


def test_jitter_factors_are_the_measured_over_modelled_quantiles() -> None:
    steps = [StepSample(0.004 * f, 1, 0, 0, 0.0) for f in (1.0, 1.0, 1.0, 2.0, 5.0)]
    config = MeasuredStepTime(step_s=0.004, per_seq_s=0.0, per_prefill_token_s=0.0)
    assert jitter_factors(config, steps, num_quantiles=5) == pytest.approx((1.0, 1.0, 1.0, 2.0, 5.0))
    with pytest.raises(ValueError, match="jitter"):
        jitter_factors(config, [], num_quantiles=5)


def test_a_real_steps_attention_work_is_counted_as_the_sims_scheduler_counts_it() -> None:
    # A new request's 100 prompt tokens after a 64-token prefix-cache hit, and two decodes at 300 and 40 tokens.
    pairs, context = attention_work({"new": 100, "a": 1, "b": 1}, {"new": 64, "a": 300, "b": 40})
    assert pairs == 100 * (64 + 101 / 2) + (300 + 1) + (40 + 1)
    assert context == 164 + 301 + 41
    # A request the engine had computed nothing of (no hit) counts from zero.
    assert attention_work({"cold": 32}, {}) == (32 * 33 / 2, 32)
