"""Diagnosing measured MFU/HFU pairs: consistent, mixed conventions (the seed), impossible, unexplained."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tessera.planner import MeasuredPair, diagnose, get_gpu, get_model, model_flops_per_token

LLAMA_70B = get_model("llama-3-70b")
H100 = get_gpu("h100-sxm")


def seed(**overrides: float) -> MeasuredPair:
    return MeasuredPair.model_validate({"mfu_percent": 35, "hfu_percent": 62, "seq_len": 32768, **overrides})


def test_seed_scenario_is_flagged_and_explained() -> None:
    result = diagnose(LLAMA_70B, H100, seed())
    assert result.verdict == "mixed-conventions"
    assert result.measured_ratio == pytest.approx(62 / 35)
    assert (result.ratio_low, result.ratio_high) == pytest.approx((61.5 / 35.5, 62.5 / 34.5))
    # The most one consistent convention allows: ~4/3 from the matmuls, a little more with FlashAttention.
    assert 1.3 < result.matmul_cap_ratio < 4 / 3 < result.consistent_cap_ratio < result.ratio_low
    assert result.best.describe().startswith(
        "MFU counts 6N (attention ignored) while HFU counts executed work"
    )
    text = " ".join(result.summary)
    assert "No consistent accounting allows this pair" in text
    assert "818 tokens/s per GPU" in text
    assert "45.1 % (causal)" in text and "55.8 % (full-square)" in text


def test_a_throughput_that_matches_6n_keeps_the_explanation() -> None:
    assert diagnose(LLAMA_70B, H100, seed(tokens_per_s_per_gpu=818)).verdict == "mixed-conventions"


def test_a_throughput_that_pins_causal_rules_the_6n_story_out() -> None:
    tokens = 0.35 * H100.peak_flops() / model_flops_per_token(LLAMA_70B, 32768, "causal")
    result = diagnose(LLAMA_70B, H100, seed(tokens_per_s_per_gpu=tokens))
    assert result.verdict == "unexplained"
    assert result.best.mfu_convention == "causal"


def test_megatron_table_5_pair_is_selective_recomputation_full_square() -> None:
    pair = MeasuredPair(mfu_percent=41.5, hfu_percent=43.7, seq_len=2048, tolerance_points=0.05)
    result = diagnose(get_model("megatron-22b"), get_gpu("a100-80gb"), pair)
    assert result.verdict == "consistent"
    best = result.best
    assert (best.mfu_convention, best.hfu_convention, best.recompute, best.flash_counted) == (
        "full",
        "full",
        "selective",
        False,
    )


def test_equal_pair_is_consistent_without_recomputation() -> None:
    result = diagnose(LLAMA_70B, H100, MeasuredPair(mfu_percent=40, hfu_percent=40, seq_len=2048))
    assert result.verdict == "consistent"
    assert result.best.recompute == "none" and not result.best.flash_counted
    assert "no recomputation" in result.best.describe()
    assert any("pin" in line for line in result.summary)  # every convention fits without a throughput


def test_hfu_above_100_is_impossible() -> None:
    result = diagnose(LLAMA_70B, H100, MeasuredPair(mfu_percent=40, hfu_percent=120, seq_len=2048))
    assert result.verdict == "impossible" and result.explanations == ()


def test_out_of_reach_ratio_is_unexplained_with_the_residual() -> None:
    result = diagnose(LLAMA_70B, H100, MeasuredPair(mfu_percent=40, hfu_percent=90, seq_len=2048))
    assert result.verdict == "unexplained"
    assert result.predicted_hfu_percent < 90
    assert any("overheads" in line for line in result.summary)


def test_pair_validation() -> None:
    with pytest.raises(ValidationError):
        MeasuredPair(mfu_percent=0, hfu_percent=62, seq_len=32768)
    with pytest.raises(ValidationError):
        MeasuredPair.model_validate({"mfu_percent": 35, "hfu_percent": 62, "seq_len": 32768, "peak": 1})
