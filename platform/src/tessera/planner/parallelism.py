"""The user-facing description of a training run: parallel degrees, batch, recomputation, ZeRO stage."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessera.planner.flops import AttentionConvention, RecomputeMode
from tessera.planner.shapes import ModelShape, can_split_heads

# Megatron's default rank order, innermost first: TP ranks are neighbours (same node), PP the outermost.
RANK_ORDER: tuple[Literal["tp", "cp", "dp", "pp"], ...] = ("tp", "cp", "dp", "pp")


class TrainingSetup(BaseModel):
    """How a model is trained: parallel degrees, batch, recomputation and sharding of model states."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seq_len: int = Field(ge=1, description="Tokens per training sequence (s).")
    micro_batch_size: int = Field(default=1, ge=1, description="Sequences per micro-batch (b).")
    num_microbatches: int = Field(
        default=1, ge=1, description="Micro-batches per step per data-parallel rank (m)."
    )
    tp: int = Field(default=1, ge=1, description="Tensor-parallel degree (t).")
    pp: int = Field(default=1, ge=1, description="Pipeline-parallel degree (p).")
    dp: int = Field(default=1, ge=1, description="Data-parallel degree (n_d).")
    cp: int = Field(
        default=1, ge=1, description="Context-parallel degree (c): each sequence split over c ranks."
    )
    sequence_parallel: bool = Field(
        default=True, description="Megatron sequence parallelism: norms and dropout split over the TP ranks."
    )
    virtual_stages: int = Field(default=1, ge=1, description="Interleaved chunks per pipeline stage (v).")
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=1, description="ZeRO stage sharding model states over DP."
    )
    recompute: RecomputeMode = Field(
        default="selective", description="Activation recomputation: none/selective/full."
    )
    flash_attention: bool = Field(
        default=True, description="Fused attention: no s² scores stored; the backward recomputes QKᵀ."
    )
    attention: AttentionConvention = Field(
        default="causal", description="Attention convention of the MFU/HFU numbers: 6N, causal or full."
    )
    gradient_bytes: int = Field(
        default=2, ge=1, le=4, description="Bytes per gradient element in the DP reduce."
    )

    @model_validator(mode="after")
    def _check(self) -> TrainingSetup:
        if self.seq_len % self.cp:
            raise ValueError(f"seq_len={self.seq_len} must be a multiple of cp={self.cp}")
        return self

    @property
    def uses_sequence_parallel(self) -> bool:
        """Sequence parallelism is defined over the TP group: with t = 1 it changes nothing."""
        return self.sequence_parallel and self.tp > 1

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def tokens_per_step(self) -> int:
        """Tokens in one global batch: ``n_d · m · b · s``."""
        return self.dp * self.num_microbatches * self.micro_batch_size * self.seq_len

    def degree(self, dimension: str) -> int:
        degrees = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        if dimension not in degrees:
            raise ValueError(f"unknown parallel dimension {dimension!r}; valid: {', '.join(degrees)}")
        return degrees[dimension]

    def check_against(self, shape: ModelShape) -> None:
        """Raise ``ValueError`` when the degrees cannot split ``shape`` (heads over TP)."""
        if not can_split_heads(shape, self.tp):
            raise ValueError(
                f"tp={self.tp} must divide the {shape.num_heads} query heads of {shape.name}, and divide or "
                f"be a multiple of its {shape.kv_heads} KV heads"
            )
        if self.pp > shape.num_layers:
            raise ValueError(f"pp={self.pp} exceeds the {shape.num_layers} layers of {shape.name}")
