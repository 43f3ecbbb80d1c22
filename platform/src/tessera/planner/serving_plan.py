"""A whole serving plan: KV rows per dtype, decode and prefill bounds, speculation, and the proposal.

Composes serving.py and propose.py into the one frozen result ``tessera plan serve`` prints. The
analysis runs at the proposed tensor-parallel size and memory share (or the asked ones when nothing
fits, so the report still says by how much it misses).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.planner.hardware import AcceleratorSpec
from tessera.planner.propose import (
    EngineProposal,
    ServeRequest,
    capacity_at,
    propose_engine_settings,
    proposed_utilization,
    tp_candidates,
)
from tessera.planner.serving import (
    KV_DTYPES,
    KVCapacity,
    RooflineBound,
    compute_dtype,
    decode_step_bound,
    expected_tokens_per_step,
    kv_bytes_per_token,
    prefill_bound,
    roofline_speculative_speedup,
    speculative_speedup,
)
from tessera.planner.shapes import ModelShape


@dataclass(frozen=True, slots=True)
class SpeculativeEstimate:
    """Leviathan et al.'s expectation and speedup, and the roofline speedup at the decode batch."""

    acceptance_rate: float
    num_speculative_tokens: int
    draft_cost_ratio: float
    expected_tokens_per_step: float
    speedup: float
    roofline_speedup: float


@dataclass(frozen=True, slots=True)
class ServingPlan:
    """Everything ``tessera plan serve`` reports."""

    shape: ModelShape
    gpu: AcceleratorSpec
    request: ServeRequest
    tp: int
    gpu_memory_utilization: float
    kv_bytes_per_token: dict[str, int]
    kv_rows: tuple[KVCapacity, ...]
    decode_batch: int
    decode: RooflineBound
    prompt_len: int
    prefill: RooflineBound
    ridge_point: float
    speculative: SpeculativeEstimate
    proposal: EngineProposal | None


def plan_serving(
    shape: ModelShape, gpu: AcceleratorSpec, request: ServeRequest, *, block_size: int = 16
) -> ServingPlan:
    """Analyse serving ``shape`` on ``gpu`` and propose engine settings (``proposal`` None: nothing fits)."""
    proposal = propose_engine_settings(shape, gpu, request, block_size=block_size)
    if proposal is not None:
        tp, utilization = proposal.tensor_parallel_size, proposal.gpu_memory_utilization
    else:
        tp = request.tp or max(tp_candidates(shape, gpu, request.max_tp))
        utilization = request.gpu_memory_utilization or proposed_utilization(gpu, request.memory_reserve_gib)
    rows = tuple(
        capacity_at(
            shape,
            gpu,
            request,
            tp=tp,
            kv_dtype=kv_dtype,
            utilization=utilization,
            context_len=request.context_len,
            block_size=block_size,
        )
        for kv_dtype in KV_DTYPES
    )
    chosen_row = next(row for row in rows if row.kv_dtype == request.kv_dtype)
    batch = request.batch or (proposal.max_num_seqs if proposal else max(1, chosen_row.concurrent_seqs))
    context = request.seq_len_for_capacity
    decode = decode_step_bound(
        shape,
        gpu,
        batch=batch,
        context_len=context,
        tp=tp,
        weight_dtype=request.weight_dtype,
        kv_dtype=request.kv_dtype,
    )
    prompt_len = request.prompt_len or request.context_len
    prefill = prefill_bound(
        shape, gpu, prompt_len=prompt_len, tp=tp, weight_dtype=request.weight_dtype, kv_dtype=request.kv_dtype
    )
    gamma = (proposal.num_speculative_tokens if proposal else None) or request.num_speculative_tokens or 3
    speculative = SpeculativeEstimate(
        acceptance_rate=request.acceptance_rate,
        num_speculative_tokens=gamma,
        draft_cost_ratio=request.draft_cost_ratio,
        expected_tokens_per_step=expected_tokens_per_step(request.acceptance_rate, gamma),
        speedup=speculative_speedup(request.acceptance_rate, gamma, request.draft_cost_ratio),
        roofline_speedup=roofline_speculative_speedup(
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
        ),
    )
    return ServingPlan(
        shape=shape,
        gpu=gpu,
        request=request,
        tp=tp,
        gpu_memory_utilization=utilization,
        kv_bytes_per_token={kv_dtype: kv_bytes_per_token(shape, kv_dtype) for kv_dtype in KV_DTYPES},
        kv_rows=rows,
        decode_batch=batch,
        decode=decode,
        prompt_len=prompt_len,
        prefill=prefill,
        ridge_point=gpu.ridge_point(compute_dtype(request.weight_dtype)),
        speculative=speculative,
        proposal=proposal,
    )
