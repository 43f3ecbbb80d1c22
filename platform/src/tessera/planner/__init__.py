"""The capacity and performance model behind Tessera's defaults (``tessera plan …``).

Pure functions over typed inputs: a :class:`ModelShape` (a preset, a shape, or a Hugging Face
``config.json``), an :class:`AcceleratorSpec`, and a :class:`TrainingSetup` or :class:`ServeRequest`.
Results are frozen dataclasses. Formulas and sources: ``docs/planner.md``.

``tessera.planner.values`` (Helm values from a proposal) is imported on its own: it is the one module
that depends on the engine's configuration model.
"""

from tessera.planner.comms import (
    CommTraffic,
    all_gather_bytes_per_rank,
    all_reduce_bytes_per_rank,
    communication,
    reduce_scatter_bytes_per_rank,
)
from tessera.planner.diagnose import Diagnosis, Explanation, MeasuredPair, diagnose
from tessera.planner.flops import (
    ATTENTION_CONVENTIONS,
    RECOMPUTE_MODES,
    AttentionConvention,
    HardwareFlops,
    RecomputeMode,
    attention_forward_flops_per_token,
    hardware_flops_per_token,
    model_flops_per_token,
    utilization,
)
from tessera.planner.hardware import AcceleratorSpec
from tessera.planner.memory import (
    ActivationMemory,
    ModelStateBytes,
    activation_bytes_per_layer,
    activation_memory,
    activation_terms,
    model_state_bytes,
)
from tessera.planner.parallelism import TrainingSetup
from tessera.planner.pipeline import PipelineBubble, layers_in_flight, pipeline_bubble
from tessera.planner.presets import GPU_PRESETS, MODEL_PRESETS, get_gpu, get_model, resolve_model
from tessera.planner.propose import EngineProposal, ServeRequest, propose_engine_settings
from tessera.planner.serving import (
    KVCapacity,
    KVDtype,
    RooflineBound,
    WeightDtype,
    decode_step_bound,
    expected_tokens_per_step,
    implied_draft_cost_ratio,
    kv_bytes_per_token,
    kv_capacity,
    prefill_bound,
    speculative_speedup,
    weight_bytes,
)
from tessera.planner.serving_plan import ServingPlan, plan_serving
from tessera.planner.shapes import ModelParams, ModelShape, count_params, read_hf_config, shape_from_hf_config
from tessera.planner.training import TrainingPlan, plan_training

__all__ = [
    "ATTENTION_CONVENTIONS",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "RECOMPUTE_MODES",
    "AcceleratorSpec",
    "ActivationMemory",
    "AttentionConvention",
    "CommTraffic",
    "Diagnosis",
    "EngineProposal",
    "Explanation",
    "HardwareFlops",
    "KVCapacity",
    "KVDtype",
    "MeasuredPair",
    "ModelParams",
    "ModelShape",
    "ModelStateBytes",
    "PipelineBubble",
    "RecomputeMode",
    "RooflineBound",
    "ServeRequest",
    "ServingPlan",
    "TrainingPlan",
    "TrainingSetup",
    "WeightDtype",
    "activation_bytes_per_layer",
    "activation_memory",
    "activation_terms",
    "all_gather_bytes_per_rank",
    "all_reduce_bytes_per_rank",
    "attention_forward_flops_per_token",
    "communication",
    "count_params",
    "decode_step_bound",
    "diagnose",
    "expected_tokens_per_step",
    "get_gpu",
    "get_model",
    "hardware_flops_per_token",
    "implied_draft_cost_ratio",
    "kv_bytes_per_token",
    "kv_capacity",
    "layers_in_flight",
    "model_flops_per_token",
    "model_state_bytes",
    "pipeline_bubble",
    "plan_serving",
    "plan_training",
    "prefill_bound",
    "propose_engine_settings",
    "read_hf_config",
    "reduce_scatter_bytes_per_rank",
    "resolve_model",
    "shape_from_hf_config",
    "speculative_speedup",
    "utilization",
    "weight_bytes",
]
