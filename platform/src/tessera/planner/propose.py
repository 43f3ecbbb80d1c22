"""Engine settings for serving a model on a GPU type, chosen from the serving formulas.

The rules, in order (each proposal carries the reasons it was made):

1. ``tensor_parallel_size``: the smallest power of two (up to a node) that splits the heads evenly and
   leaves KV room for ``min_concurrent_seqs`` sequences of ``avg_seq_len`` tokens, and at least one of
   ``context_len``. More TP than that buys KV room but pays an all-reduce per layer on every step.
2. ``kv_cache_dtype``: FP8 unless asked otherwise; it doubles KV capacity (vLLM's ``fp8`` is E4M3).
3. ``gpu_memory_utilization``: leave ``memory_reserve_gib`` outside vLLM's budget (allocator
   fragmentation, other processes), at most 0.95.
4. ``max_num_seqs``: the sequences of ``avg_seq_len`` that the KV cache holds, capped, rounded down to a
   multiple of 8. Beyond it the scheduler would preempt.
5. speculative decoding: only when it pays at that batch (verifying γ+1 tokens per sequence is charged
   on the roofline, so a compute-bound step gains nothing), with the smallest γ after which one more
   drafted token would add less than 10 % to the speedup at acceptance rate α.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tessera.planner._units import GIB, KIB
from tessera.planner.hardware import AcceleratorSpec
from tessera.planner.serving import (
    KVCapacity,
    KVDtype,
    WeightDtype,
    activation_peak_bytes,
    decode_step_bound,
    kv_capacity,
    roofline_speculative_speedup,
)
from tessera.planner.shapes import ModelShape, can_split_heads

SpeculativeChoice = Literal["ngram", "mtp", "eagle", "eagle3", "draft_model", "none"]
MAX_UTILIZATION = 0.95
MIN_USEFUL_SPEEDUP = 1.05
MAX_SPECULATIVE_TOKENS = 8
MIN_MARGINAL_GAIN = 1.10
# vLLM's name for each planner KV dtype ("auto" keeps the model dtype, BF16 for the presets).
ENGINE_KV_DTYPE: dict[str, Literal["auto", "fp8"]] = {"bf16": "auto", "fp8": "fp8"}


class ServeRequest(BaseModel):
    """What ``tessera plan serve`` is asked: the workload, the constraints and the assumptions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    context_len: int = Field(ge=16, description="Longest sequence, prompt + output (max_model_len), tokens.")
    avg_seq_len: int | None = Field(
        default=None,
        ge=1,
        description="Tokens a sequence holds on average; sizes max_num_seqs. Null: context_len.",
    )
    prompt_len: int | None = Field(
        default=None, ge=1, description="Prompt length for the prefill bound; null: context_len."
    )
    tp: int | None = Field(
        default=None, ge=1, description="Tensor-parallel size; null lets the planner choose."
    )
    max_tp: int = Field(default=8, ge=1, description="Largest tensor-parallel size the planner may choose.")
    gpus: int | None = Field(
        default=None, ge=1, description="GPUs for this model; replicas = gpus // tp. Null: one replica."
    )
    kv_dtype: Literal["bf16", "fp8"] = Field(default="fp8", description="KV cache element type to deploy.")
    weight_dtype: WeightDtype = Field(default="bf16", description="Weight element type of the checkpoint.")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0.0, le=1.0, description="vLLM's memory share; null lets the planner choose."
    )
    memory_reserve_gib: float = Field(
        default=3.0, ge=0.0, description="Memory left outside vLLM's budget, GiB."
    )
    runtime_overhead_gib: float = Field(
        default=1.0,
        ge=0.0,
        description="CUDA context, cuBLAS workspace and NCCL buffers inside the budget, GiB.",
    )
    max_num_batched_tokens: int = Field(
        default=8192, ge=16, description="Tokens per forward; sizes the activation peak."
    )
    min_concurrent_seqs: int = Field(
        default=16, ge=1, description="Sequences of avg_seq_len the KV cache must hold."
    )
    max_num_seqs_cap: int = Field(default=256, ge=1, description="Upper limit on the proposed max_num_seqs.")
    batch: int | None = Field(
        default=None, ge=1, description="Decode batch for the bounds; null: the proposed max_num_seqs."
    )
    speculative_method: SpeculativeChoice = Field(default="ngram", description="Draft method, or 'none'.")
    draft_model: str | None = Field(
        default=None, description="Draft checkpoint (eagle, eagle3, draft_model)."
    )
    acceptance_rate: float = Field(
        default=0.7, ge=0.0, le=1.0, description="Assumed draft acceptance rate α."
    )
    num_speculative_tokens: int | None = Field(
        default=None, ge=1, le=16, description="Drafted tokens γ; null lets the planner choose."
    )
    draft_cost_ratio: float = Field(
        default=0.0, ge=0.0, description="Draft step time over target step time (c)."
    )

    @property
    def seq_len_for_capacity(self) -> int:
        return self.avg_seq_len if self.avg_seq_len is not None else self.context_len


@dataclass(frozen=True, slots=True)
class EngineProposal:
    """Proposed engine settings and why; ``speculative_method`` is None when speculation is off."""

    tensor_parallel_size: int
    kv_cache_dtype: Literal["auto", "fp8"]
    max_num_seqs: int
    max_model_len: int
    gpu_memory_utilization: float
    speculative_method: str | None
    num_speculative_tokens: int | None
    draft_model: str | None
    speculative_speedup: float | None
    replicas: int
    capacity: KVCapacity
    reasons: tuple[str, ...]


def tp_candidates(shape: ModelShape, gpu: AcceleratorSpec, max_tp: int) -> tuple[int, ...]:
    """Powers of two up to a node that split the query heads evenly, and the KV heads evenly or by
    replication."""
    limit = min(max_tp, gpu.gpus_per_node)
    sizes = []
    t = 1
    while t <= limit:
        if can_split_heads(shape, t):
            sizes.append(t)
        t *= 2
    return tuple(sizes)


def proposed_utilization(gpu: AcceleratorSpec, reserve_gib: float) -> float:
    """``1 − reserve/memory`` rounded down to hundredths, at most 0.95."""
    share = 1.0 - reserve_gib * GIB / gpu.memory_bytes
    return min(MAX_UTILIZATION, math.floor(share * 100) / 100)


def capacity_at(
    shape: ModelShape,
    gpu: AcceleratorSpec,
    request: ServeRequest,
    *,
    tp: int,
    kv_dtype: KVDtype,
    utilization: float,
    context_len: int,
    block_size: int,
) -> KVCapacity:
    """KV capacity with this request's activation peak and runtime overhead."""
    peak = activation_peak_bytes(shape, tp, request.max_num_batched_tokens, request.max_num_seqs_cap)
    return kv_capacity(
        shape,
        gpu,
        kv_dtype=kv_dtype,
        context_len=context_len,
        tp=tp,
        weight_dtype=request.weight_dtype,
        gpu_memory_utilization=utilization,
        activation_peak=peak,
        runtime_overhead=request.runtime_overhead_gib * GIB,
        block_size=block_size,
    )


def _choose_speculation(
    shape: ModelShape, gpu: AcceleratorSpec, request: ServeRequest, *, tp: int, batch: int
) -> tuple[int | None, float | None, str]:
    if request.speculative_method == "none":
        return None, None, "speculative decoding off (asked)"
    context = request.seq_len_for_capacity
    step = decode_step_bound(
        shape,
        gpu,
        batch=batch,
        context_len=context,
        tp=tp,
        weight_dtype=request.weight_dtype,
        kv_dtype=request.kv_dtype,
    )

    def speedup_at(gamma: int) -> float:
        return roofline_speculative_speedup(
            shape,
            gpu,
            alpha=request.acceptance_rate,
            gamma=gamma,
            draft_cost_ratio=request.draft_cost_ratio,
            batch=batch,
            context_len=context,
            tp=tp,
            weight_dtype=request.weight_dtype,
            kv_dtype=request.kv_dtype,
        )

    if request.num_speculative_tokens is not None:
        best_gamma = request.num_speculative_tokens
    else:
        # The knee: stop once one more drafted token adds less than MIN_MARGINAL_GAIN. Leviathan's α is
        # the same for every position; in practice acceptance falls along a draft, so the tail is worth less.
        best_gamma = 1
        while (
            best_gamma < MAX_SPECULATIVE_TOKENS
            and speedup_at(best_gamma + 1) >= speedup_at(best_gamma) * MIN_MARGINAL_GAIN
        ):
            best_gamma += 1
    best_speedup = speedup_at(best_gamma)
    if best_speedup < MIN_USEFUL_SPEEDUP:
        return (
            None,
            best_speedup,
            (
                f"speculative decoding off: at batch {batch} a decode step is {step.regime}; "
                f"γ={best_gamma} would give {best_speedup:.2f}×"
            ),
        )
    return (
        best_gamma,
        best_speedup,
        (
            f"{request.speculative_method} speculation with γ={best_gamma}: decode at batch {batch} is "
            f"{step.regime}; at α={request.acceptance_rate:.2f} the roofline speedup is {best_speedup:.2f}×"
        ),
    )


def propose_engine_settings(
    shape: ModelShape, gpu: AcceleratorSpec, request: ServeRequest, *, block_size: int = 16
) -> EngineProposal | None:
    """Engine settings for ``request``; ``None`` when no tensor-parallel size up to ``max_tp`` fits."""
    if request.tp is not None and not can_split_heads(shape, request.tp):
        valid = ", ".join(str(t) for t in tp_candidates(shape, gpu, gpu.gpus_per_node))
        raise ValueError(
            f"tp={request.tp} cannot split the heads of {shape.name}; valid up to a node: {valid}"
        )
    utilization = request.gpu_memory_utilization or proposed_utilization(gpu, request.memory_reserve_gib)
    sizes = (request.tp,) if request.tp is not None else tp_candidates(shape, gpu, request.max_tp)
    chosen: tuple[int, KVCapacity] | None = None
    for tp in sizes:
        if request.gpus is not None and tp > request.gpus:
            break
        capacity = capacity_at(
            shape,
            gpu,
            request,
            tp=tp,
            kv_dtype=request.kv_dtype,
            utilization=utilization,
            context_len=request.seq_len_for_capacity,
            block_size=block_size,
        )
        longest = capacity.capacity_tokens >= math.ceil(request.context_len / block_size) * block_size
        if longest and capacity.concurrent_seqs >= request.min_concurrent_seqs:
            chosen = (tp, capacity)
            break
    if chosen is None:
        return None
    tp, capacity = chosen
    seqs = min(capacity.concurrent_seqs, request.max_num_seqs_cap)
    max_num_seqs = seqs - seqs % 8 if seqs >= 8 else seqs
    gamma, speedup, spec_reason = _choose_speculation(shape, gpu, request, tp=tp, batch=max_num_seqs)
    reasons = (
        f"tensor_parallel_size={tp}: smallest size whose KV cache holds {request.min_concurrent_seqs} "
        f"sequences of {request.seq_len_for_capacity} tokens ({capacity.concurrent_seqs} fit)",
        f"kv_cache_dtype={ENGINE_KV_DTYPE[request.kv_dtype]}: "
        f"{capacity.kv_bytes_per_token / KIB:.0f} KiB per token per GPU",
        f"gpu_memory_utilization={utilization:.2f}: "
        + (
            "as asked"
            if request.gpu_memory_utilization
            else f"leaves {request.memory_reserve_gib:g} GiB outside vLLM"
        ),
        f"max_num_seqs={max_num_seqs}: KV capacity {capacity.capacity_tokens} tokens per replica, capped at "
        f"{request.max_num_seqs_cap}",
        spec_reason,
    )
    return EngineProposal(
        tensor_parallel_size=tp,
        kv_cache_dtype=ENGINE_KV_DTYPE[request.kv_dtype],
        max_num_seqs=max(1, max_num_seqs),
        max_model_len=request.context_len,
        gpu_memory_utilization=utilization,
        speculative_method=request.speculative_method if gamma is not None else None,
        num_speculative_tokens=gamma,
        draft_model=request.draft_model if gamma is not None else None,
        speculative_speedup=speedup,
        replicas=max(1, request.gpus // tp) if request.gpus is not None else 1,
        capacity=capacity,
        reasons=reasons,
    )
