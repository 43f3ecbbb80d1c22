"""Serving: weight and KV bytes, KV capacity per GPU, decode/prefill roofline bounds, speculative decoding.

* KV bytes per token: ``2 · L · g · d · e_kv`` (a key and a value per KV head per layer). Tensor
  parallelism splits the g heads over t GPUs; when t > g, vLLM replicates heads so each GPU keeps one.
* KV capacity per GPU: ``(memory × utilisation − weights − activation peak − runtime overhead)`` over
  the KV bytes per token on that GPU, rounded down to whole KV blocks. The activation peak is the
  transient memory of a forward over ``max_num_batched_tokens`` tokens (vLLM's profiling run); the
  runtime overhead is the CUDA context, cuBLAS workspace and NCCL buffers that also count against the
  budget. FP8 KV halves the bytes per token, so it doubles the capacity (the vLLM docs' "approximately
  double": the same free memory over half the bytes).
* Decode step lower bound: every weight that takes part in a matmul and every cached key and value is
  read once per step, so the step takes at least ``(N_mm·e_w + batch·context·KV bytes) / HBM bandwidth``;
  it also needs ``(2·N_mm + 4·L·a·d·context) · batch`` FLOPs (weights, then QKᵀ and PV over the
  context). The larger of the two is the bound; which one says whether the step is memory- or
  compute-bound (arithmetic intensity against the ridge point, peak / bandwidth).
* Prefill lower bound: ``(2·N_mm·S + 2·L·a·d·S²) / peak`` per S-token prompt (causal attention).
* Speculative decoding (Leviathan et al. 2023): with acceptance rate α and γ drafted tokens, a target
  step yields ``(1 − α^(γ+1)) / (1 − α)`` tokens on average; with draft/target step-time ratio c the
  wall-time speedup is that over ``γ·c + 1``. The roofline variant also charges the target for verifying
  γ+1 tokens per sequence, which is free only while the step stays memory-bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from tessera.planner.hardware import AcceleratorSpec, ComputeDtype
from tessera.planner.shapes import ModelShape, count_params, kv_heads_per_gpu

KVDtype = Literal["bf16", "fp8", "int8"]
WeightDtype = Literal["bf16", "fp8", "int8", "int4"]
KV_DTYPES: tuple[KVDtype, ...] = ("bf16", "fp8", "int8")
KV_DTYPE_BYTES: dict[KVDtype, int] = {"bf16": 2, "fp8": 1, "int8": 1}
WEIGHT_DTYPE_BYTES: dict[WeightDtype, float] = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
LOGIT_BYTES = 4


def kv_bytes_per_token(shape: ModelShape, kv_dtype: KVDtype) -> int:
    """``2 · L · g · d · e_kv`` for the whole model."""
    return 2 * shape.num_layers * shape.kv_width * KV_DTYPE_BYTES[kv_dtype]


def kv_bytes_per_token_per_gpu(shape: ModelShape, kv_dtype: KVDtype, tp: int) -> float:
    return 2 * shape.num_layers * kv_heads_per_gpu(shape, tp) * shape.head_size * KV_DTYPE_BYTES[kv_dtype]


def weight_bytes(shape: ModelShape, weight_dtype: WeightDtype) -> float:
    """Every parameter at ``weight_dtype`` (norms and biases included)."""
    return count_params(shape).total * WEIGHT_DTYPE_BYTES[weight_dtype]


def compute_dtype(weight_dtype: WeightDtype) -> ComputeDtype:
    """FP8 weights run FP8 matmuls (W8A8); int8/int4 weight-only kernels dequantise to BF16."""
    return "fp8" if weight_dtype == "fp8" else "bf16"


def activation_peak_bytes(shape: ModelShape, tp: int, num_batched_tokens: int, max_num_seqs: int) -> float:
    """Transient memory of one forward over ``num_batched_tokens`` tokens on one GPU, 16-bit.

    The widest tensors live at once: the residual stream and its normalised copy (2·h), the fused QKV
    output ((a+2g)·d/t) and the MLP's up-projection output and activation (gate+up+product 3·f/t for
    SwiGLU, 2·f/t for GeLU); then the FP32 logits and probabilities of the sampled positions, gathered
    over the whole vocabulary on every rank.
    """
    widths = 2 * shape.hidden_size + (shape.query_width + 2 * shape.kv_width) / tp
    widths += (3 if shape.gated_mlp else 2) * shape.ffn_hidden_size / tp
    sampled = min(max_num_seqs, num_batched_tokens)
    return 2.0 * num_batched_tokens * widths + 2.0 * LOGIT_BYTES * sampled * shape.vocab_size


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """How much KV cache one GPU of a replica holds, and how many sequences that serves."""

    kv_dtype: KVDtype
    budget_bytes: float
    weights_bytes: float
    activation_peak_bytes: float
    runtime_overhead_bytes: float
    kv_bytes_per_token: float
    block_size: int
    capacity_tokens: int
    context_len: int
    concurrent_seqs: int

    @property
    def free_bytes(self) -> float:
        return (
            self.budget_bytes - self.weights_bytes - self.activation_peak_bytes - self.runtime_overhead_bytes
        )

    @property
    def fits(self) -> bool:
        """Whether one full-length sequence fits next to the weights."""
        return self.concurrent_seqs >= 1


def kv_capacity(
    shape: ModelShape,
    gpu: AcceleratorSpec,
    *,
    kv_dtype: KVDtype,
    context_len: int,
    tp: int = 1,
    weight_dtype: WeightDtype = "bf16",
    gpu_memory_utilization: float = 0.9,
    activation_peak: float = 0.0,
    runtime_overhead: float = 0.0,
    block_size: int = 16,
) -> KVCapacity:
    """KV capacity per GPU at ``context_len`` tokens per sequence (whole blocks per sequence)."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must lie in (0, 1], got {gpu_memory_utilization}")
    if context_len < 1 or block_size < 1:
        raise ValueError("context_len and block_size must be >= 1")
    per_token = kv_bytes_per_token_per_gpu(shape, kv_dtype, tp)
    budget = gpu.memory_bytes * gpu_memory_utilization
    weights = weight_bytes(shape, weight_dtype) / tp
    free = budget - weights - activation_peak - runtime_overhead
    num_blocks = max(0, math.floor(free / (per_token * block_size)))
    blocks_per_seq = math.ceil(context_len / block_size)
    return KVCapacity(
        kv_dtype=kv_dtype,
        budget_bytes=budget,
        weights_bytes=weights,
        activation_peak_bytes=activation_peak,
        runtime_overhead_bytes=runtime_overhead,
        kv_bytes_per_token=per_token,
        block_size=block_size,
        capacity_tokens=num_blocks * block_size,
        context_len=context_len,
        concurrent_seqs=num_blocks // blocks_per_seq,
    )


@dataclass(frozen=True, slots=True)
class RooflineBound:
    """A lower bound on one step's time on one GPU: the slower of moving its bytes and doing its FLOPs."""

    flops: float
    bytes_moved: float
    peak_flops: float
    hbm_bandwidth_bytes_per_s: float

    @property
    def compute_time_s(self) -> float:
        return self.flops / self.peak_flops

    @property
    def memory_time_s(self) -> float:
        return self.bytes_moved / self.hbm_bandwidth_bytes_per_s

    @property
    def time_s(self) -> float:
        return max(self.compute_time_s, self.memory_time_s)

    @property
    def arithmetic_intensity(self) -> float:
        """FLOPs per byte moved; above the ridge point the step is compute-bound."""
        return self.flops / self.bytes_moved

    @property
    def regime(self) -> Literal["memory-bound", "compute-bound"]:
        return "memory-bound" if self.memory_time_s >= self.compute_time_s else "compute-bound"


def decode_step_bound(
    shape: ModelShape,
    gpu: AcceleratorSpec,
    *,
    batch: int,
    context_len: int,
    tp: int = 1,
    weight_dtype: WeightDtype = "bf16",
    kv_dtype: KVDtype = "bf16",
    tokens_per_seq: int = 1,
) -> RooflineBound:
    """One decode step of ``batch`` sequences at ``context_len`` cached tokens, per GPU of a TP group.

    ``tokens_per_seq`` > 1 is a speculative verification step: γ+1 query tokens per sequence against the
    same weights and cache.
    """
    if batch < 1 or context_len < 0 or tokens_per_seq < 1:
        raise ValueError("decode needs batch >= 1, context_len >= 0 and tokens_per_seq >= 1")
    matmul_params = count_params(shape).matmul
    attention_flops = 4.0 * shape.num_layers * shape.query_width * context_len
    flops = (2.0 * matmul_params + attention_flops) * batch * tokens_per_seq / tp
    weights_read = matmul_params * WEIGHT_DTYPE_BYTES[weight_dtype] / tp
    kv_read = batch * context_len * kv_bytes_per_token_per_gpu(shape, kv_dtype, tp)
    return RooflineBound(
        flops=flops,
        bytes_moved=weights_read + kv_read,
        peak_flops=gpu.peak_flops(compute_dtype(weight_dtype)),
        hbm_bandwidth_bytes_per_s=gpu.hbm_bandwidth_bytes_per_s,
    )


def prefill_bound(
    shape: ModelShape,
    gpu: AcceleratorSpec,
    *,
    prompt_len: int,
    tp: int = 1,
    weight_dtype: WeightDtype = "bf16",
    kv_dtype: KVDtype = "bf16",
    batch: int = 1,
) -> RooflineBound:
    """Prefill of ``batch`` prompts of S tokens: ``2·N_mm·S + 2·L·a·d·S²`` FLOPs each (causal)."""
    if prompt_len < 1 or batch < 1:
        raise ValueError("prefill needs prompt_len >= 1 and batch >= 1")
    matmul_params = count_params(shape).matmul
    per_prompt = 2.0 * matmul_params * prompt_len + 2.0 * shape.num_layers * shape.query_width * prompt_len**2
    weights_read = matmul_params * WEIGHT_DTYPE_BYTES[weight_dtype] / tp
    kv_written = batch * prompt_len * kv_bytes_per_token_per_gpu(shape, kv_dtype, tp)
    return RooflineBound(
        flops=per_prompt * batch / tp,
        bytes_moved=weights_read + kv_written,
        peak_flops=gpu.peak_flops(compute_dtype(weight_dtype)),
        hbm_bandwidth_bytes_per_s=gpu.hbm_bandwidth_bytes_per_s,
    )


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """Leviathan et al.: ``(1 − α^(γ+1)) / (1 − α)`` tokens per target step (γ+1 when α = 1)."""
    if not 0.0 <= alpha <= 1.0 or gamma < 0:
        raise ValueError(f"need 0 <= alpha <= 1 and gamma >= 0, got alpha={alpha}, gamma={gamma}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speculative_speedup(alpha: float, gamma: int, draft_cost_ratio: float) -> float:
    """Leviathan et al.'s wall-time speedup ``(1 − α^(γ+1)) / ((1 − α)(γ·c + 1))``."""
    if draft_cost_ratio < 0:
        raise ValueError(f"draft_cost_ratio must be >= 0, got {draft_cost_ratio}")
    return expected_tokens_per_step(alpha, gamma) / (gamma * draft_cost_ratio + 1.0)


def implied_draft_cost_ratio(alpha: float, gamma: int, measured_speedup: float) -> float:
    """The c that makes :func:`speculative_speedup` equal a measured speedup (inverse of the formula)."""
    if gamma < 1 or measured_speedup <= 0:
        raise ValueError("need gamma >= 1 and a positive measured speedup")
    return (expected_tokens_per_step(alpha, gamma) / measured_speedup - 1.0) / gamma


def roofline_speculative_speedup(
    shape: ModelShape,
    gpu: AcceleratorSpec,
    *,
    alpha: float,
    gamma: int,
    draft_cost_ratio: float,
    batch: int,
    context_len: int,
    tp: int = 1,
    weight_dtype: WeightDtype = "bf16",
    kv_dtype: KVDtype = "bf16",
) -> float:
    """Speedup when verification is charged on the roofline: γ+1 query tokens per sequence per step."""
    plain = decode_step_bound(
        shape, gpu, batch=batch, context_len=context_len, tp=tp, weight_dtype=weight_dtype, kv_dtype=kv_dtype
    ).time_s
    verify = decode_step_bound(
        shape,
        gpu,
        batch=batch,
        context_len=context_len,
        tp=tp,
        weight_dtype=weight_dtype,
        kv_dtype=kv_dtype,
        tokens_per_seq=gamma + 1,
    ).time_s
    return expected_tokens_per_step(alpha, gamma) * plain / (verify + gamma * draft_cost_ratio * plain)
