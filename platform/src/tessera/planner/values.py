"""Helm values from an engine proposal, validated by the engine's own configuration model.

The chart reads ``models[].engine`` as the camelCase aliases of :class:`tessera.engine.config.EngineConfig`.
The block is built by constructing an ``EngineConfig`` (so the engine's validators run on it) and dumping
it with ``exclude_defaults``, then putting back every proposed field even where it equals the default:
a values file that says ``kvCacheDtype: fp8`` keeps saying it if the default ever changes.
"""

from __future__ import annotations

from typing import Any

import yaml

from tessera.engine.config import EngineConfig, SpeculativeConfig
from tessera.planner.propose import EngineProposal

# The engine's block size, so the planner's block rounding matches what the values file deploys.
ENGINE_BLOCK_SIZE: int = EngineConfig.model_fields["block_size"].default
PROPOSED_FIELDS = (
    "model",
    "served_model_name",
    "kv_cache_dtype",
    "tensor_parallel_size",
    "max_num_seqs",
    "max_model_len",
    "gpu_memory_utilization",
    "speculative",
)


def engine_config(proposal: EngineProposal, *, model_path: str, served_model_name: str) -> EngineConfig:
    """The proposal as an :class:`EngineConfig` (pydantic's ``ValidationError`` if the engine refuses it)."""
    speculative = None
    if proposal.speculative_method is not None and proposal.num_speculative_tokens is not None:
        speculative = SpeculativeConfig.model_validate(
            {
                "method": proposal.speculative_method,
                "num_speculative_tokens": proposal.num_speculative_tokens,
                "draft_model": proposal.draft_model,
            }
        )
    return EngineConfig(
        model=model_path,
        served_model_name=served_model_name,
        kv_cache_dtype=proposal.kv_cache_dtype,
        tensor_parallel_size=proposal.tensor_parallel_size,
        max_num_seqs=proposal.max_num_seqs,
        max_model_len=proposal.max_model_len,
        gpu_memory_utilization=proposal.gpu_memory_utilization,
        speculative=speculative,
    )


def engine_values(config: EngineConfig) -> dict[str, Any]:
    """The chart's ``engine`` block: proposed fields first, then any other non-default field."""
    non_default = config.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    everything = config.model_dump(mode="json", by_alias=True)
    aliases = {name: EngineConfig.model_fields[name].alias or name for name in PROPOSED_FIELDS}
    block: dict[str, Any] = {aliases[name]: everything[aliases[name]] for name in PROPOSED_FIELDS}
    if config.speculative is not None:
        spec = config.speculative.model_dump(mode="json", by_alias=True, exclude_defaults=True)
        block["speculative"] = {
            "method": config.speculative.method,
            "numSpeculativeTokens": config.speculative.num_speculative_tokens,
            **spec,
        }
    block.update({key: value for key, value in non_default.items() if key not in block})
    return block


def helm_values(proposal: EngineProposal, *, model_path: str, served_model_name: str) -> dict[str, Any]:
    """A values document with one entry under ``models``."""
    config = engine_config(proposal, model_path=model_path, served_model_name=served_model_name)
    return {
        "models": [
            {"name": served_model_name, "replicas": proposal.replicas, "engine": engine_values(config)},
        ]
    }


def render_values_yaml(values: dict[str, Any], *, header: tuple[str, ...] = ()) -> str:
    """YAML text with ``header`` lines as comments (the proposal's reasons)."""
    comments = "".join(f"# {line}\n" for line in header)
    return comments + yaml.safe_dump(values, sort_keys=False, default_flow_style=False)
