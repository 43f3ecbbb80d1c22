"""A whole training plan: parameters, FLOPs, memory per GPU, communication, bubble, MFU and HFU.

This module only composes the formula modules (flops, memory, comms, pipeline) into one frozen result
that ``tessera plan train`` prints; it adds two choices of its own:

* the memory peak is the larger of the first pipeline stage (most activations in flight, the input
  embedding) and the last (one micro-batch in flight, the FP32 logits and the output projection);
* the compute-bound step time charges the work the kernels really execute: the causal half of the
  scores with FlashAttention, the whole square without it (an unfused kernel computes, then masks).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.planner.comms import CommTraffic, communication
from tessera.planner.flops import (
    RECOMPUTE_MODES,
    ConventionFlops,
    RecomputeMode,
    flops_by_convention,
    hardware_flops_per_token,
    model_flops_per_token,
    utilization,
)
from tessera.planner.hardware import AcceleratorSpec
from tessera.planner.memory import ActivationMemory, ModelStateBytes, activation_memory, model_state_bytes
from tessera.planner.parallelism import TrainingSetup
from tessera.planner.pipeline import PipelineBubble, layers_in_flight, pipeline_bubble, stage_layers
from tessera.planner.shapes import ModelParams, ModelShape, count_params


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Memory of one GPU on one pipeline stage, bytes."""

    stage: str
    params: float
    states: ModelStateBytes
    activations: ActivationMemory

    @property
    def total(self) -> float:
        return self.states.total + self.activations.total


@dataclass(frozen=True, slots=True)
class ActivationModeRow:
    """Activation bytes for one recomputation mode, with or without sequence parallelism."""

    recompute: RecomputeMode
    sequence_parallel: bool
    bytes_per_layer: float
    bytes_per_gpu: float


@dataclass(frozen=True, slots=True)
class MeasuredUtilization:
    """MFU and HFU of a measured throughput, under the setup's attention convention."""

    tokens_per_s: float
    mfu: float
    hfu: float


@dataclass(frozen=True, slots=True)
class TrainingPlan:
    """Everything ``tessera plan train`` reports."""

    shape: ModelShape
    gpu: AcceleratorSpec
    setup: TrainingSetup
    params: ModelParams
    flops: tuple[ConventionFlops, ...]
    memory: StageMemory
    gpu_memory_bytes: int
    activation_modes: tuple[ActivationModeRow, ...]
    traffic: tuple[CommTraffic, ...]
    bubble: PipelineBubble
    compute_time_lower_bound_s: float
    measured: MeasuredUtilization | None

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu_memory_bytes


def _stage_params(shape: ModelShape, params: ModelParams, pp: int, tp: int) -> tuple[float, float]:
    """Parameters on one GPU of the first and of the last pipeline stage."""
    pieces = params.breakdown
    layers = stage_layers(shape.num_layers, pp) * (
        pieces.attention_per_layer + pieces.mlp_per_layer + pieces.norm_and_bias_per_layer
    )
    head = pieces.output_projection + pieces.final_norm
    inputs = pieces.embedding + pieces.position_embedding
    if pp == 1:
        return (layers + inputs + head) / tp, (layers + inputs + head) / tp
    # With tied embeddings the last stage keeps its own copy of the matrix for the logits.
    last_extra = pieces.embedding if shape.tie_embeddings else 0
    return (layers + inputs) / tp, (layers + head + last_extra) / tp


def _stage_memory(
    shape: ModelShape, setup: TrainingSetup, stage: str, params_here: float, rank: int, with_logits: bool
) -> StageMemory:
    states = model_state_bytes(params_here, setup.zero_stage, setup.dp * setup.cp)
    in_flight = layers_in_flight(
        shape.num_layers, setup.pp, setup.num_microbatches, setup.virtual_stages, rank
    )
    activations = activation_memory(
        shape,
        setup.seq_len,
        setup.micro_batch_size,
        tp=setup.tp,
        sequence_parallel=setup.uses_sequence_parallel,
        recompute=setup.recompute,
        layers_in_flight=in_flight,
        flash_attention=setup.flash_attention,
        cp=setup.cp,
        include_logits=with_logits,
    )
    return StageMemory(stage=stage, params=params_here, states=states, activations=activations)


def _activation_modes(shape: ModelShape, setup: TrainingSetup) -> tuple[ActivationModeRow, ...]:
    in_flight = layers_in_flight(shape.num_layers, setup.pp, setup.num_microbatches, setup.virtual_stages)
    rows = []
    for recompute in RECOMPUTE_MODES:
        for sp in (False, True) if setup.tp > 1 else (False,):
            memory = activation_memory(
                shape,
                setup.seq_len,
                setup.micro_batch_size,
                tp=setup.tp,
                sequence_parallel=sp,
                recompute=recompute,
                layers_in_flight=in_flight,
                flash_attention=setup.flash_attention,
                cp=setup.cp,
                include_logits=False,
            )
            rows.append(ActivationModeRow(recompute, sp, memory.per_layer, memory.layers))
    return tuple(rows)


def plan_training(
    shape: ModelShape,
    gpu: AcceleratorSpec,
    setup: TrainingSetup,
    *,
    tokens_per_s: float | None = None,
    step_time_s: float | None = None,
) -> TrainingPlan:
    """Compose the training report; give ``tokens_per_s`` (global) or ``step_time_s`` for MFU/HFU."""
    setup.check_against(shape)
    if tokens_per_s is not None and step_time_s is not None:
        raise ValueError("give tokens_per_s or step_time_s, not both")
    params = count_params(shape)
    first_params, last_params = _stage_params(shape, params, setup.pp, setup.tp)
    first = _stage_memory(shape, setup, "first", first_params, 0, with_logits=setup.pp == 1)
    memory = first
    if setup.pp > 1:
        last = _stage_memory(shape, setup, "last", last_params, setup.pp - 1, with_logits=True)
        memory = max(first, last, key=lambda stage: stage.total)
    bubble = pipeline_bubble(setup.pp, setup.num_microbatches, setup.virtual_stages)
    executed = hardware_flops_per_token(
        shape,
        setup.seq_len,
        "causal" if setup.flash_attention else "full",
        setup.recompute,
        setup.flash_attention,
    ).total
    peak = gpu.peak_flops("bf16")
    compute_s = executed * setup.tokens_per_step / (setup.num_gpus * peak) * (1.0 + bubble.fraction_of_ideal)
    if step_time_s is not None:
        if step_time_s <= 0:
            raise ValueError(f"step_time_s must be positive, got {step_time_s}")
        tokens_per_s = setup.tokens_per_step / step_time_s
    measured = None
    if tokens_per_s is not None:
        model = model_flops_per_token(shape, setup.seq_len, setup.attention)
        hardware = hardware_flops_per_token(
            shape, setup.seq_len, setup.attention, setup.recompute, setup.flash_attention
        ).total
        measured = MeasuredUtilization(
            tokens_per_s=tokens_per_s,
            mfu=utilization(tokens_per_s, model, setup.num_gpus, peak),
            hfu=utilization(tokens_per_s, hardware, setup.num_gpus, peak),
        )
    return TrainingPlan(
        shape=shape,
        gpu=gpu,
        setup=setup,
        params=params,
        flops=flops_by_convention(shape, setup.seq_len, setup.recompute, setup.flash_attention),
        memory=memory,
        gpu_memory_bytes=gpu.memory_bytes,
        activation_modes=_activation_modes(shape, setup),
        traffic=communication(shape, gpu, setup),
        bubble=bubble,
        compute_time_lower_bound_s=compute_s,
        measured=measured,
    )
