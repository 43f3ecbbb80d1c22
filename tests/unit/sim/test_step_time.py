"""Step-time models (step_time.py): the roofline preset's regimes and the measured linear model."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from tessera.engine.sim.scheduler import StepShape
from tessera.engine.sim.step_time import (
    MeasuredStepTime,
    RooflineStepTime,
    StepTimeConfig,
    roofline_num_gpu_blocks,
    step_time_fn,
)
from tessera.planner.presets import get_gpu, get_model
from tessera.planner.serving import decode_step_bound


def decode(num_seqs: int, context: int) -> StepShape:
    return StepShape(num_seqs, 0, num_seqs, num_seqs, num_seqs * (context + 1.0), num_seqs * (context + 1))


def test_a_small_decode_is_the_planners_memory_bound_plus_the_step_overhead() -> None:
    config = RooflineStepTime(compute_efficiency=1.0, memory_efficiency=1.0)
    bound = decode_step_bound(get_model("llama-3-70b"), get_gpu("h100-sxm"), batch=1, context_len=1001, tp=8,
                              kv_dtype="fp8")
    assert bound.regime == "memory-bound"
    assert step_time_fn(config)(decode(1, 1000)) == pytest.approx(bound.time_s + config.step_overhead_s, rel=1e-3)


def test_a_long_prefill_is_compute_bound_and_grows_with_its_tokens() -> None:
    fn = step_time_fn(RooflineStepTime())
    one, two = (fn(StepShape(n, n, 0, 1, n * (n + 1) / 2, n)) for n in (2048, 4096))
    assert one > 0.05
    assert two > 2 * one - RooflineStepTime().step_overhead_s  # attention makes it superlinear


def test_the_measured_model_is_linear_in_sequences_and_prefill_tokens() -> None:
    fn = step_time_fn(MeasuredStepTime(step_s=0.01, per_seq_s=0.001, per_prefill_token_s=0.0001))
    assert fn(StepShape(100, 98, 2, 3, 0.0, 0)) == pytest.approx(0.01 + 2 * 0.001 + 98 * 0.0001)
    assert fn(StepShape(0, 0, 0, 0, 0.0, 0)) == 0.0


def test_the_preset_holds_an_h100_tp8_llama_70b_fp8_kv_cache() -> None:
    blocks = roofline_num_gpu_blocks(RooflineStepTime(), block_size=16, max_model_len=8192)
    # 8 × 80 GB × 0.9 minus 140 GB of weights, at 160 KiB of FP8 KV per token over 8 GPUs: millions of tokens.
    assert 1_000_000 < (blocks - 1) * 16 < 5_000_000


def test_configs_are_strict_and_chosen_by_kind() -> None:
    adapter: TypeAdapter[RooflineStepTime | MeasuredStepTime] = TypeAdapter(StepTimeConfig)
    assert isinstance(adapter.validate_python({"kind": "measured", "step_s": 0.01, "per_seq_s": 0,
                                               "per_prefill_token_s": 0}), MeasuredStepTime)
    with pytest.raises(ValidationError):
        adapter.validate_python({"kind": "roofline", "gpus": "h100-sxm"})
    with pytest.raises(ValueError, match="llama-3-70b"):
        step_time_fn(RooflineStepTime(model="llama-9"))


def test_the_mix_and_attention_terms_add_per_prefill_sequence_and_per_query_key_pair() -> None:
    base = MeasuredStepTime(step_s=0.01, per_seq_s=0.001, per_prefill_token_s=0.0001)
    full = base.model_copy(update={"per_prefill_seq_s": 0.002, "per_attention_pair_s": 1e-8})
    # Two prefills (98 tokens) and one decode: two prefill sequences, 5,000 query-key pairs.
    step = StepShape(99, 98, 1, 3, 5000.0, 500)
    assert step_time_fn(full)(step) == pytest.approx(step_time_fn(base)(step) + 2 * 0.002 + 5000 * 1e-8)
    # A decode-only step pays no mix term.
    assert step_time_fn(full)(decode(3, 10)) == pytest.approx(step_time_fn(base)(decode(3, 10)) + 3 * 11 * 1e-8)


def test_the_context_term_adds_per_token_of_kv_the_step_reads() -> None:
    base = MeasuredStepTime(step_s=0.01, per_seq_s=0.001, per_prefill_token_s=0.0001)
    with_context = base.model_copy(update={"per_context_token_s": 2e-7})
    for step in (decode(3, 10), decode(3, 1000), StepShape(99, 98, 1, 3, 5000.0, 500)):
        assert step_time_fn(with_context)(step) == pytest.approx(step_time_fn(base)(step)
                                                                 + 2e-7 * step.num_context_tokens)
    # A decode batch at a long context costs more than the same batch at a short one.
    assert step_time_fn(with_context)(decode(3, 1000)) > step_time_fn(with_context)(decode(3, 10))


def test_a_measured_config_without_the_new_terms_stays_valid_and_unchanged() -> None:
    config = MeasuredStepTime.model_validate({"step_s": 0.01, "per_seq_s": 0.001, "per_prefill_token_s": 0.0001})
    assert (config.per_prefill_seq_s, config.per_attention_pair_s, config.per_context_token_s) == (0.0, 0.0, 0.0)
    with pytest.raises(ValidationError):
        MeasuredStepTime.model_validate({"step_s": 0.01, "per_seq_s": 0.0, "per_prefill_token_s": 0.0,
                                         "per_prefill_seq_s": -1.0})


def test_jitter_draws_seeded_factors_between_the_measured_quantiles() -> None:
    base = MeasuredStepTime(step_s=0.01, per_seq_s=0.0, per_prefill_token_s=0.0)
    noisy = base.model_copy(update={"jitter_factors": (0.9, 1.0, 3.0), "jitter_seed": 5})
    first, again = step_time_fn(noisy), step_time_fn(noisy)
    times = [first(decode(1, 10)) for _ in range(2000)]
    assert times == [again(decode(1, 10)) for _ in range(2000)]  # the same seed, the same steps
    assert min(times) >= 0.009 - 1e-12 and max(times) <= 0.03 + 1e-12
    # Half the draws fall between the first two quantiles (0.9-1.0), half between the last two (1.0-3.0).
    assert sum(t <= 0.01 for t in times) / len(times) == pytest.approx(0.5, abs=0.05)
    assert step_time_fn(base)(decode(1, 10)) == 0.01
    with pytest.raises(ValidationError):
        MeasuredStepTime(step_s=0.01, per_seq_s=0.0, per_prefill_token_s=0.0, jitter_factors=(1.2, 1.0))


def test_additive_jitter_adds_the_same_seconds_to_a_decode_and_a_long_prefill() -> None:
    base = MeasuredStepTime(step_s=0.004, per_seq_s=0.0, per_prefill_token_s=0.00004)
    noisy = base.model_copy(update={"jitter_s": (-0.001, 0.0, 0.005), "jitter_seed": 3})
    prefill = StepShape(1000, 1000, 0, 1, 500_500.0, 1000)
    for step in (decode(1, 10), prefill):
        first, again = step_time_fn(noisy), step_time_fn(noisy)
        added = [first(step) - step_time_fn(base)(step) for _ in range(2000)]
        assert added == [again(step) - step_time_fn(base)(step) for _ in range(2000)]  # seeded
        # Between the first and last quantile, half the draws under 0 and half over: seconds, not a factor.
        assert min(added) >= -0.001 - 1e-12 and max(added) <= 0.005 + 1e-12
        assert sum(a <= 0 for a in added) / len(added) == pytest.approx(0.5, abs=0.05)
    # A draw below a step's own time leaves it at 0, never negative.
    tiny = MeasuredStepTime(step_s=0.0005, per_seq_s=0.0, per_prefill_token_s=0.0, jitter_s=(-0.002, -0.001))
    assert all(step_time_fn(tiny)(decode(1, 10)) == 0.0 for _ in range(100))
    with pytest.raises(ValidationError):
        base.model_validate({**base.model_dump(), "jitter_s": (0.002, 0.001)})
