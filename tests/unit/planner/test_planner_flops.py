"""FLOPs per token and utilisation, against values worked out by hand for the tiny model (conftest)."""

from __future__ import annotations

import pytest

from tessera.planner import (
    ModelShape,
    attention_forward_flops_per_token,
    count_params,
    hardware_flops_per_token,
    model_flops_per_token,
    utilization,
)
from tessera.planner.flops import check_convention, check_recompute, tokens_per_s_at

S = 6  # sequence length for the hand-worked values


def test_params(tiny: ModelShape) -> None:
    params = count_params(tiny)
    assert (params.total, params.matmul, params.layers_matmul, params.logits) == (1352, 1232, 1152, 80)


def test_attention_forward(tiny: ModelShape) -> None:
    # 4·L·a·d·s = 4·2·8·6 = 384 over the full square; the causal half; nothing under 6N.
    assert attention_forward_flops_per_token(tiny, S, "full") == 384
    assert attention_forward_flops_per_token(tiny, S, "causal") == 192
    assert attention_forward_flops_per_token(tiny, S, "6N") == 0


@pytest.mark.parametrize(
    ("convention", "expected"),
    [("6N", 6 * 1352), ("causal", 6 * 1232 + 3 * 192), ("full", 6 * 1232 + 3 * 384)],
)
def test_model_flops(tiny: ModelShape, convention: str, expected: float) -> None:
    assert model_flops_per_token(tiny, S, check_convention(convention)) == expected


def test_hardware_flops_by_mode(tiny: ModelShape) -> None:
    causal_model = 7968  # 6·1232 + 3·192
    # full: every layer's forward again, 2·1152 + 192 = 2496 (the logit layer is not recomputed)
    full = hardware_flops_per_token(tiny, S, "causal", "full")
    assert (full.model, full.recompute, full.flash_recompute) == (causal_model, 2496, 0)
    # selective, as Korthikanti et al. count it: the attention term once more, 3·192
    assert hardware_flops_per_token(tiny, S, "causal", "selective").total == causal_model + 576
    # FlashAttention recomputes QKᵀ in the backward: half an attention forward, 96
    assert (
        hardware_flops_per_token(tiny, S, "causal", "full", flash_attention=True).total
        == causal_model + 2496 + 96
    )
    # with FlashAttention, selective recomputation has nothing left to recompute
    assert (
        hardware_flops_per_token(tiny, S, "causal", "selective", flash_attention=True).total
        == causal_model + 96
    )
    # a fraction of the forward
    assert hardware_flops_per_token(tiny, S, "causal", 0.5).recompute == 1248
    # 6N: only the layers' matmuls are recomputed
    assert hardware_flops_per_token(tiny, S, "6N", "full").total == 6 * 1352 + 2304
    assert hardware_flops_per_token(tiny, S, "causal", "none").ratio_to_model == 1.0


def test_bad_inputs_list_the_valid_options(tiny: ModelShape) -> None:
    with pytest.raises(ValueError, match="6N, causal, full"):
        check_convention("square")
    with pytest.raises(ValueError, match="none, selective, full"):
        check_recompute("partial")
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        hardware_flops_per_token(tiny, S, "causal", 1.5)


def test_utilization_and_its_inverse() -> None:
    assert utilization(100, 8112, 2, 1e6) == pytest.approx(0.4056)
    assert tokens_per_s_at(0.4056, 8112, 2, 1e6) == pytest.approx(100)
    with pytest.raises(ValueError):
        utilization(100, 8112, 0, 1e6)
