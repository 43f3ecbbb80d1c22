"""How long one engine step takes, from what it computes (``StepShape``): two models, chosen by ``kind``.

* ``roofline``: the planner's roofline (``planner/serving.py``) for a GPU, model and tensor parallelism,
  applied to a mixed step. Per GPU of the TP group the step does ``(2·N_mm·T + 4·L·a·d·P) / t`` FLOPs
  (T scheduled tokens, P query-key pairs of causal attention) and moves ``N_mm·e_w / t`` weight bytes plus
  the KV it reads; it takes the slower of the two at the given efficiencies, plus a fixed overhead per step
  (scheduler, sampling, TP all-reduces). The roofline is a lower bound; the efficiencies say how far from
  it the modelled engine runs.
* ``measured``: a linear model fitted on a real engine (the CPU engine's step costs): a fixed cost per
  step, per sequence in the batch, per prefill token, and optionally per sequence still in its prompt (the
  mix term: a prefill's inputs, metadata and first sample cost more than a decode's), per query-key pair
  of causal attention (a long prompt's quadratic part) and per token of KV the step reads (a decoding
  sequence's share of a step grows with its context). Calibration (``bench/bench_sim_calibration.py``)
  fits these on the CPU engine's own step timings (``step_time_fit.py``) and configures the sim with them.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tessera.engine.sim.scheduler import StepShape
from tessera.planner.presets import get_gpu, get_model
from tessera.planner.serving import (
    WEIGHT_DTYPE_BYTES,
    KVDtype,
    WeightDtype,
    compute_dtype,
    kv_bytes_per_token_per_gpu,
    kv_capacity,
)
from tessera.planner.shapes import count_params

StepTimeFn = Callable[[StepShape], float]


class RooflineStepTime(BaseModel):
    """Step time from the planner's roofline. Defaults: H100 SXM, Llama-3-70B, TP8, FP8 KV."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["roofline"] = Field(default="roofline", description="Selects the roofline model.")
    gpu: str = Field(default="h100-sxm", description="Planner GPU preset (`tessera plan` lists them).")
    model: str = Field(default="llama-3-70b", description="Planner model preset.")
    tensor_parallel_size: int = Field(default=8, ge=1, description="GPUs per replica (TP).")
    weight_dtype: WeightDtype = Field(default="bf16", description="Weight dtype (FP8 weights run FP8 matmuls).")
    kv_cache_dtype: KVDtype = Field(default="fp8", description="KV cache dtype (bytes read per cached token).")
    compute_efficiency: float = Field(
        default=0.5, gt=0.0, le=1.0,
        description="Share of peak FLOP/s the step's matmuls reach (an assumption, not a measurement).")
    memory_efficiency: float = Field(
        default=0.8, gt=0.0, le=1.0,
        description="Share of HBM bandwidth the step's reads reach (an assumption, not a measurement).")
    step_overhead_s: float = Field(
        default=0.002, ge=0.0,
        description="Fixed seconds per step: scheduling, sampling, TP all-reduces (an assumption).")


class MeasuredStepTime(BaseModel):
    """Step time from a real engine's measured costs: ``step + per_seq·(seqs − 1) + per_prefill_token·tokens
    + per_prefill_seq·prefill_seqs + per_attention_pair·pairs + per_context_token·context`` (the last three
    default to 0)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["measured"] = Field(default="measured", description="Selects the measured model.")
    step_s: float = Field(ge=0.0, description="Seconds per step whatever it holds (a 1-sequence decode).")
    per_seq_s: float = Field(ge=0.0, description="Seconds per sequence in the batch beyond the first.")
    per_prefill_token_s: float = Field(ge=0.0, description="Seconds per prompt token computed.")
    per_prefill_seq_s: float = Field(
        default=0.0, ge=0.0,
        description="Seconds per sequence computing prompt tokens in the step (beyond its per-sequence cost).")
    per_attention_pair_s: float = Field(
        default=0.0, ge=0.0,
        description="Seconds per query-key pair of causal attention (the step's ``attention_pairs``).")
    per_context_token_s: float = Field(
        default=0.0, ge=0.0,
        description=("Seconds per token of KV the step reads (``num_context_tokens``: every scheduled sequence's "
                     "cached context and new tokens): what a decode step's attention costs per sequence grows "
                     "with, where a query-key pair is one token's worth."))
    jitter_factors: tuple[float, ...] = Field(
        default=(),
        description=("Step-time multipliers at evenly spaced quantiles (first: the smallest, last: the largest) "
                     "of the real engine's measured/modelled step time — a shared machine's noise. Each step "
                     "draws one (seeded, interpolated between quantiles). Empty: every step takes its model time."))
    jitter_s: tuple[float, ...] = Field(
        default=(),
        description=("Seconds added to a step at evenly spaced quantiles (ascending) of the real engine's measured "
                     "minus modelled step time — a shared machine's interruptions, which add time whatever the step "
                     "computes (a factor would stretch a long prefill by as much as it stretches a decode). Each "
                     "step draws one (seeded, interpolated between quantiles); a step never takes less than 0. "
                     "Empty: none."))
    jitter_seed: int = Field(default=0, description="Seed of the jitter draws (the same seed, the same steps).")

    @field_validator("jitter_factors")
    @classmethod
    def _sorted_positive(cls, factors: tuple[float, ...]) -> tuple[float, ...]:
        if any(f <= 0 for f in factors) or list(factors) != sorted(factors):
            raise ValueError("jitter_factors must be positive quantiles in ascending order")
        return factors

    @field_validator("jitter_s")
    @classmethod
    def _sorted(cls, seconds: tuple[float, ...]) -> tuple[float, ...]:
        if list(seconds) != sorted(seconds):
            raise ValueError("jitter_s must be quantiles in ascending order")
        return seconds


StepTimeConfig = Annotated[RooflineStepTime | MeasuredStepTime, Field(discriminator="kind")]


def roofline_step_time(config: RooflineStepTime) -> StepTimeFn:
    shape, gpu = get_model(config.model), get_gpu(config.gpu)
    tp = config.tensor_parallel_size
    matmul_params = count_params(shape).matmul
    weight_bytes_per_gpu = matmul_params * WEIGHT_DTYPE_BYTES[config.weight_dtype] / tp
    kv_bytes_per_token = kv_bytes_per_token_per_gpu(shape, config.kv_cache_dtype, tp)
    attention_flops_per_pair = 4.0 * shape.num_layers * shape.query_width
    flops_per_s = gpu.peak_flops(compute_dtype(config.weight_dtype)) * config.compute_efficiency
    bytes_per_s = gpu.hbm_bandwidth_bytes_per_s * config.memory_efficiency

    def step_time(step: StepShape) -> float:
        if step.num_scheduled_tokens == 0:
            return 0.0
        flops = (2.0 * matmul_params * step.num_scheduled_tokens
                 + attention_flops_per_pair * step.attention_pairs) / tp
        bytes_moved = weight_bytes_per_gpu + step.num_context_tokens * kv_bytes_per_token
        return max(flops / flops_per_s, bytes_moved / bytes_per_s) + config.step_overhead_s

    return step_time


def measured_step_time(config: MeasuredStepTime) -> StepTimeFn:
    rng = random.Random(config.jitter_seed)

    def draw(quantiles: tuple[float, ...], none: float) -> float:
        """A value between evenly spaced quantiles, interpolated (``none`` where there are none)."""
        if len(quantiles) < 2:
            return quantiles[0] if quantiles else none
        position = rng.random() * (len(quantiles) - 1)
        low = int(position)
        return quantiles[low] + (quantiles[low + 1] - quantiles[low]) * (position - low)

    def step_time(step: StepShape) -> float:
        if step.num_scheduled_tokens == 0:
            return 0.0
        num_prefill_seqs = step.num_seqs - step.num_decode_seqs
        modelled = draw(config.jitter_factors, 1.0) * (
            config.step_s + config.per_seq_s * max(0, step.num_seqs - 1)
            + config.per_prefill_token_s * step.num_prefill_tokens
            + config.per_prefill_seq_s * num_prefill_seqs
            + config.per_attention_pair_s * step.attention_pairs
            + config.per_context_token_s * step.num_context_tokens)
        return max(0.0, modelled + draw(config.jitter_s, 0.0)) if config.jitter_s else modelled

    return step_time


_MODELS: dict[str, Callable[..., StepTimeFn]] = {"roofline": roofline_step_time, "measured": measured_step_time}


def step_time_fn(config: RooflineStepTime | MeasuredStepTime) -> StepTimeFn:
    try:
        make = _MODELS[config.kind]
    except KeyError:
        raise ValueError(f"unknown step-time model {config.kind!r}; valid: {', '.join(sorted(_MODELS))}") from None
    return make(config)


def roofline_num_gpu_blocks(config: RooflineStepTime, block_size: int, max_model_len: int,
                            gpu_memory_utilization: float = 0.9) -> int:
    """KV blocks the planner says one replica of this GPU/model/TP holds (plus vLLM's null block)."""
    capacity = kv_capacity(get_model(config.model), get_gpu(config.gpu), kv_dtype=config.kv_cache_dtype,
                           context_len=max_model_len, tp=config.tensor_parallel_size,
                           weight_dtype=config.weight_dtype, gpu_memory_utilization=gpu_memory_utilization,
                           block_size=block_size)
    return capacity.capacity_tokens // block_size + 1
