"""KV bytes and capacity, roofline bounds and speculative decoding, against hand-worked values."""

from __future__ import annotations

import pytest

from tessera.planner import (
    AcceleratorSpec,
    ModelShape,
    decode_step_bound,
    expected_tokens_per_step,
    get_model,
    implied_draft_cost_ratio,
    kv_bytes_per_token,
    kv_capacity,
    prefill_bound,
    speculative_speedup,
    weight_bytes,
)
from tessera.planner.serving import (
    activation_peak_bytes,
    kv_bytes_per_token_per_gpu,
    roofline_speculative_speedup,
)


def test_kv_bytes_per_token(tiny: ModelShape) -> None:
    assert kv_bytes_per_token(tiny, "bf16") == 2 * 2 * 1 * 4 * 2  # 2 · L · g · d · e
    assert kv_bytes_per_token(tiny, "fp8") == kv_bytes_per_token(tiny, "int8") == 16


def test_kv_heads_split_or_replicate_over_tp() -> None:
    llama = get_model("llama-3-70b")  # g = 8
    assert kv_bytes_per_token_per_gpu(llama, "bf16", 4) == 2 * 80 * 2 * 128 * 2
    assert kv_bytes_per_token_per_gpu(llama, "bf16", 16) == 2 * 80 * 1 * 128 * 2  # one replicated head


def test_weight_bytes(tiny: ModelShape) -> None:
    assert weight_bytes(tiny, "bf16") == 2704
    assert weight_bytes(tiny, "int4") == 676


def test_capacity_by_hand(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    # budget 10,000 × 0.5 = 5000; weights 2704 → 2296 free; 32 B/token in blocks of 4 (128 B) → 17 blocks,
    # 68 tokens; a 10-token sequence takes 3 blocks → 5 sequences.
    cap = kv_capacity(
        tiny, toy_gpu, kv_dtype="bf16", context_len=10, gpu_memory_utilization=0.5, block_size=4
    )
    assert (cap.free_bytes, cap.capacity_tokens, cap.concurrent_seqs, cap.fits) == (2296, 68, 5, True)
    peaked = kv_capacity(
        tiny,
        toy_gpu,
        kv_dtype="bf16",
        context_len=10,
        gpu_memory_utilization=0.5,
        activation_peak=196,
        runtime_overhead=100,
        block_size=4,
    )
    assert (peaked.free_bytes, peaked.capacity_tokens) == (2000, 60)
    too_small = kv_capacity(tiny, toy_gpu, kv_dtype="bf16", context_len=10, gpu_memory_utilization=0.25)
    assert too_small.capacity_tokens == 0 and not too_small.fits
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_capacity(tiny, toy_gpu, kv_dtype="bf16", context_len=10, gpu_memory_utilization=1.5)


def test_activation_peak_by_hand(tiny: ModelShape) -> None:
    # widths 2·8 + (8 + 2·4) + 3·16 = 80 → 2 bytes × 4 tokens × 80 = 640; logits and probabilities of
    # 2 sampled rows in FP32: 2 × 4 × 2 × 10 = 160.
    assert activation_peak_bytes(tiny, 1, 4, 2) == 800


def test_decode_bound_by_hand(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    # FLOPs (2·1232 + 4·2·8·10) × 2 = 6208; bytes 1232·2 + 2·10·32 = 3104.
    bound = decode_step_bound(tiny, toy_gpu, batch=2, context_len=10)
    assert (bound.flops, bound.bytes_moved) == (6208, 3104)
    assert (bound.compute_time_s, bound.memory_time_s, bound.time_s) == (6.208, 15.52, 15.52)
    assert bound.regime == "memory-bound" and bound.arithmetic_intensity == 2.0
    verify = decode_step_bound(tiny, toy_gpu, batch=2, context_len=10, tokens_per_seq=3)
    assert verify.flops == 3 * 6208 and verify.regime == "compute-bound"


def test_fp8_weights_use_the_fp8_peak(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    bound = decode_step_bound(tiny, toy_gpu, batch=2, context_len=10, weight_dtype="fp8")
    assert bound.peak_flops == 2000 and bound.bytes_moved == 1232 + 640


def test_prefill_bound_by_hand(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    # 2·1232·10 + 2·L·a·d·S² = 24640 + 2·2·8·100 = 27840 FLOPs; bytes 2464 + 10·32 = 2784.
    bound = prefill_bound(tiny, toy_gpu, prompt_len=10)
    assert (bound.flops, bound.bytes_moved) == (27840, 2784)
    assert bound.regime == "compute-bound" and bound.time_s == 27.84
    assert toy_gpu.ridge_point() == 5.0


def test_speculative_formulas() -> None:
    assert expected_tokens_per_step(0.0, 5) == 1.0
    assert expected_tokens_per_step(1.0, 3) == 4.0
    assert expected_tokens_per_step(0.5, 2) == 1.75  # (1 − 0.125) / 0.5
    assert speculative_speedup(0.5, 2, 0.25) == pytest.approx(1.75 / 1.5)
    assert implied_draft_cost_ratio(0.5, 2, 1.75 / 1.5) == pytest.approx(0.25)
    with pytest.raises(ValueError):
        expected_tokens_per_step(1.2, 3)


def test_roofline_speculation_charges_verification(tiny: ModelShape, toy_gpu: AcceleratorSpec) -> None:
    # plain step 15.52 s (memory); verifying 3 tokens per sequence is compute-bound at 18.624 s.
    speedup = roofline_speculative_speedup(
        tiny, toy_gpu, alpha=0.5, gamma=2, draft_cost_ratio=0.0, batch=2, context_len=10
    )
    assert speedup == pytest.approx(1.75 * 15.52 / 18.624)
