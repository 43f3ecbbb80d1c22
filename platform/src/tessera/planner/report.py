"""JSON-ready reports of the three plans: the keys ``tessera plan … --json`` prints (docs/planner.md).

The CLI renders its tables from these same dictionaries, so the table and the JSON cannot disagree.
Memory is in GiB (binary), bandwidth-derived times in seconds, FLOPs and bytes as plain numbers,
utilisations in percent.
"""

from __future__ import annotations

from typing import Any

from tessera.planner._units import GIB
from tessera.planner.diagnose import Diagnosis, Explanation
from tessera.planner.serving import RooflineBound
from tessera.planner.serving_plan import ServingPlan
from tessera.planner.training import TrainingPlan


def training_report(plan: TrainingPlan) -> dict[str, Any]:
    setup, memory = plan.setup, plan.memory
    return {
        "model": plan.shape.name,
        "gpu": plan.gpu.name,
        "setup": setup.model_dump(mode="json"),
        "num_gpus": setup.num_gpus,
        "tokens_per_step": setup.tokens_per_step,
        "parameters": {"total": plan.params.total, "matmul": plan.params.matmul, "per_gpu": memory.params},
        "attention_convention": setup.attention,
        "flops_per_token": {
            row.convention: {"model": row.model, "hardware": row.hardware.total} for row in plan.flops
        },
        "memory_per_gpu_gib": {
            "stage": memory.stage,
            "weights": memory.states.weights / GIB,
            "gradients": memory.states.gradients / GIB,
            "optimizer_states": memory.states.optimizer / GIB,
            "activations": memory.activations.layers / GIB,
            "logits": memory.activations.logits / GIB,
            "total": memory.total / GIB,
            "capacity": plan.gpu_memory_bytes / GIB,
            "fits": plan.fits,
        },
        "activation_gib_by_mode": [
            {
                "recompute": row.recompute,
                "sequence_parallel": row.sequence_parallel,
                "per_layer_gib": row.bytes_per_layer / GIB,
                "per_gpu_gib": row.bytes_per_gpu / GIB,
            }
            for row in plan.activation_modes
        ],
        "communication": [
            {
                "dimension": row.dimension,
                "degree": row.degree,
                "collective": row.collective,
                "bytes_per_step": row.bytes_per_step,
                "link": row.link,
                "time_nvlink_s": row.time_nvlink_s,
                "time_infiniband_s": row.time_infiniband_s,
            }
            for row in plan.traffic
        ],
        "pipeline_bubble": {
            "fraction_of_ideal": plan.bubble.fraction_of_ideal,
            "share_of_step": plan.bubble.share_of_step,
        },
        "compute_time_lower_bound_s": plan.compute_time_lower_bound_s,
        "measured": None
        if plan.measured is None
        else {
            "tokens_per_s": plan.measured.tokens_per_s,
            "mfu_percent": 100.0 * plan.measured.mfu,
            "hfu_percent": 100.0 * plan.measured.hfu,
        },
    }


def _explanation(e: Explanation) -> dict[str, Any]:
    return {
        "mfu_convention": e.mfu_convention,
        "hfu_convention": e.hfu_convention,
        "recompute": e.recompute,
        "recompute_fraction": e.recompute_fraction,
        "flash_attention_counted": e.flash_counted,
        "predicted_ratio": e.predicted_ratio,
        "consistent": e.consistent,
        "description": e.describe(),
    }


def diagnosis_report(d: Diagnosis, *, model: str, gpu: str) -> dict[str, Any]:
    return {
        "model": model,
        "gpu": gpu,
        "seq_len": d.pair.seq_len,
        "mfu_percent": d.pair.mfu_percent,
        "hfu_percent": d.pair.hfu_percent,
        "measured_ratio": d.measured_ratio,
        "ratio_low": d.ratio_low,
        "ratio_high": d.ratio_high,
        "matmul_cap_ratio": d.matmul_cap_ratio,
        "consistent_cap_ratio": d.consistent_cap_ratio,
        "verdict": d.verdict,
        "best": _explanation(d.best),
        "explanations": [_explanation(e) for e in d.explanations],
        "implied_tokens_per_s_per_gpu": d.implied_tokens_per_s_per_gpu,
        "mfu_percent_by_convention": d.mfu_percent_by_convention,
        "predicted_hfu_percent": d.predicted_hfu_percent,
        "summary": list(d.summary),
    }


def _bound(bound: RooflineBound) -> dict[str, Any]:
    return {
        "time_s": bound.time_s,
        "memory_time_s": bound.memory_time_s,
        "compute_time_s": bound.compute_time_s,
        "flops": bound.flops,
        "bytes": bound.bytes_moved,
        "arithmetic_intensity": bound.arithmetic_intensity,
        "regime": bound.regime,
    }


def serving_report(plan: ServingPlan) -> dict[str, Any]:
    request, proposal, spec = plan.request, plan.proposal, plan.speculative
    chosen = next(row for row in plan.kv_rows if row.kv_dtype == request.kv_dtype)
    return {
        "model": plan.shape.name,
        "gpu": plan.gpu.name,
        "tensor_parallel_size": plan.tp,
        "gpu_memory_utilization": plan.gpu_memory_utilization,
        "context_len": request.context_len,
        "weights_gib_per_gpu": chosen.weights_bytes / GIB,
        "activation_peak_gib": chosen.activation_peak_bytes / GIB,
        "runtime_overhead_gib": chosen.runtime_overhead_bytes / GIB,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv": [
            {
                "kv_dtype": row.kv_dtype,
                "bytes_per_token_per_gpu": row.kv_bytes_per_token,
                "free_gib": row.free_bytes / GIB,
                "capacity_tokens": row.capacity_tokens,
                "concurrent_seqs": row.concurrent_seqs,
            }
            for row in plan.kv_rows
        ],
        "decode": {
            "batch": plan.decode_batch,
            "context_len": request.seq_len_for_capacity,
            "tokens_per_s_upper_bound": plan.decode_batch / plan.decode.time_s,
            **_bound(plan.decode),
        },
        "prefill": {"prompt_len": plan.prompt_len, **_bound(plan.prefill)},
        "ridge_point_flops_per_byte": plan.ridge_point,
        "speculative": {
            "acceptance_rate": spec.acceptance_rate,
            "num_speculative_tokens": spec.num_speculative_tokens,
            "draft_cost_ratio": spec.draft_cost_ratio,
            "expected_tokens_per_step": spec.expected_tokens_per_step,
            "speedup": spec.speedup,
            "roofline_speedup": spec.roofline_speedup,
        },
        "proposal": None
        if proposal is None
        else {
            "tensor_parallel_size": proposal.tensor_parallel_size,
            "kv_cache_dtype": proposal.kv_cache_dtype,
            "max_num_seqs": proposal.max_num_seqs,
            "max_model_len": proposal.max_model_len,
            "gpu_memory_utilization": proposal.gpu_memory_utilization,
            "speculative": None
            if proposal.speculative_method is None
            else {
                "method": proposal.speculative_method,
                "num_speculative_tokens": proposal.num_speculative_tokens,
                "speedup": proposal.speculative_speedup,
            },
            "replicas": proposal.replicas,
            "reasons": list(proposal.reasons),
        },
    }
