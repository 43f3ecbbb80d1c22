"""Training FLOPs per token, model (MFU) and hardware (HFU), under a stated attention convention.

Forward FLOPs per token: ``2·N_mm`` for the weight matmuls, plus the attention core: QKᵀ and PV are two
matmuls of ``2·a·d·s`` FLOPs per token per layer over the full s × s square, ``4·L·a·d·s`` in all. A
training step runs the forward once and the backward (two matmuls per forward matmul) once: 3× forward.

Attention conventions (always state which one a utilisation number uses; at 32k context it moves MFU by
10–20 points):

* ``6N``: ``6·N`` with N every parameter; attention ignored (the Kaplan/Chinchilla shorthand).
* ``causal``: ``6·N_mm + 6·L·a·d·s``; a causal kernel skips the masked half of the square.
* ``full``: ``6·N_mm + 12·L·a·d·s``; the whole square (PaLM appendix B, Korthikanti et al. 2022).

MFU divides model FLOPs by peak; HFU divides what the hardware executed, recomputation included:

* selective recomputation re-runs the attention core. Korthikanti et al. charge it as the attention
  term once more (their hardware FLOPs are ``72·B·L·s·h²·(1 + s/(3h) + V/(12hL))``); the planner uses
  their count so that their published HFU reproduces. A strict count of one forward of QKᵀ and PV would
  charge a third of that.
* full recomputation re-runs every layer's forward before its backward: ``2·N_layers + attention
  forward``; the logit layer is not recomputed (Korthikanti's ``96·B·L·s·h²·(1 + s/(6h) + V/(16hL))``).
  So HFU/MFU is at most 4/3 under one convention.
* a fraction ``r`` in [0, 1] re-runs that share of every layer's forward (partial rematerialisation).
* FlashAttention's backward recomputes the score matrix (QKᵀ): half an attention forward, which the
  hardware executes whatever the recomputation mode. With FlashAttention, selective recomputation has
  nothing left to do (no scores are stored), so it costs nothing beyond the kernel's own recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tessera.planner.shapes import ModelShape, count_params

AttentionConvention = Literal["6N", "causal", "full"]
RecomputeMode = Literal["none", "selective", "full"]

ATTENTION_CONVENTIONS: tuple[AttentionConvention, ...] = ("6N", "causal", "full")
RECOMPUTE_MODES: tuple[RecomputeMode, ...] = ("none", "selective", "full")
# Share of the full s × s score square that a convention counts.
_SQUARE_SHARE: dict[AttentionConvention, float] = {"6N": 0.0, "causal": 0.5, "full": 1.0}
CONVENTION_LABELS: dict[AttentionConvention, str] = {
    "6N": "6N (attention ignored)",
    "causal": "causal (half the score square)",
    "full": "full-square (PaLM / Megatron)",
}


def check_convention(convention: str) -> AttentionConvention:
    """``convention`` as a typed value; ``ValueError`` lists the valid ones."""
    for valid in ATTENTION_CONVENTIONS:
        if convention == valid:
            return valid
    raise ValueError(
        f"unknown attention convention {convention!r}; valid: {', '.join(ATTENTION_CONVENTIONS)}"
    )


def check_recompute(mode: str) -> RecomputeMode:
    """``mode`` as a typed value; ``ValueError`` lists the valid ones."""
    for valid in RECOMPUTE_MODES:
        if mode == valid:
            return valid
    raise ValueError(f"unknown recomputation mode {mode!r}; valid: {', '.join(RECOMPUTE_MODES)}")


def attention_forward_flops_per_token(
    shape: ModelShape, seq_len: int, convention: AttentionConvention
) -> float:
    """FLOPs of QKᵀ and PV for one token's forward pass, all layers: ``4·L·a·d·s`` × the counted share."""
    full_square = 4 * shape.num_layers * shape.query_width * seq_len
    return full_square * _SQUARE_SHARE[convention]


def model_flops_per_token(shape: ModelShape, seq_len: int, convention: AttentionConvention) -> float:
    """Model FLOPs per trained token (forward + backward, no recomputation): the MFU numerator."""
    params = count_params(shape)
    if convention == "6N":
        return 6.0 * params.total
    return 6.0 * params.matmul + 3.0 * attention_forward_flops_per_token(shape, seq_len, convention)


@dataclass(frozen=True, slots=True)
class HardwareFlops:
    """FLOPs per trained token the hardware executes: the HFU numerator, split by cause."""

    model: float
    recompute: float
    flash_recompute: float

    @property
    def total(self) -> float:
        return self.model + self.recompute + self.flash_recompute

    @property
    def ratio_to_model(self) -> float:
        """HFU/MFU when both use this object's convention."""
        return self.total / self.model


def recompute_flops_per_token(
    shape: ModelShape, seq_len: int, convention: AttentionConvention, recompute: RecomputeMode | float
) -> float:
    """Extra forward work per token that recomputation adds (see the module docstring for each mode)."""
    attention_forward = attention_forward_flops_per_token(shape, seq_len, convention)
    layers_forward = 2.0 * count_params(shape).layers_matmul + attention_forward
    if isinstance(recompute, float | int) and not isinstance(recompute, bool):
        if not 0.0 <= recompute <= 1.0:
            raise ValueError(f"recompute fraction must lie in [0, 1], got {recompute}")
        return float(recompute) * layers_forward
    if recompute == "none":
        return 0.0
    if recompute == "selective":
        # NOTE: Korthikanti et al.'s accounting (the attention term once more), not one strict forward.
        return 3.0 * attention_forward
    if recompute == "full":
        return layers_forward
    raise ValueError(f"unknown recomputation mode {recompute!r}; valid: {', '.join(RECOMPUTE_MODES)}")


def hardware_flops_per_token(
    shape: ModelShape,
    seq_len: int,
    convention: AttentionConvention,
    recompute: RecomputeMode | float,
    flash_attention: bool = False,
) -> HardwareFlops:
    """Executed FLOPs per trained token under ``convention``: model work, recomputation, FlashAttention's
    backward recompute of the scores (half an attention forward)."""
    flash = 0.5 * attention_forward_flops_per_token(shape, seq_len, convention) if flash_attention else 0.0
    # NOTE: with FlashAttention there are no stored scores for selective recomputation to drop: the
    # kernel's own backward recompute is the selective recompute, so it is not charged twice.
    extra = 0.0 if flash_attention and recompute == "selective" else None
    return HardwareFlops(
        model=model_flops_per_token(shape, seq_len, convention),
        recompute=extra
        if extra is not None
        else recompute_flops_per_token(shape, seq_len, convention, recompute),
        flash_recompute=flash,
    )


def utilization(
    tokens_per_s: float, flops_per_token: float, num_devices: int, peak_flops_per_device: float
) -> float:
    """Achieved FLOP rate over peak, as a fraction: MFU with model FLOPs, HFU with hardware FLOPs."""
    if tokens_per_s < 0 or flops_per_token <= 0 or num_devices < 1 or peak_flops_per_device <= 0:
        raise ValueError(
            "utilization needs tokens_per_s >= 0, flops_per_token > 0, num_devices >= 1, peak > 0"
        )
    return tokens_per_s * flops_per_token / (num_devices * peak_flops_per_device)


def tokens_per_s_at(
    utilization_fraction: float, flops_per_token: float, num_devices: int, peak: float
) -> float:
    """The throughput that a utilisation implies (the inverse of :func:`utilization`)."""
    return utilization_fraction * num_devices * peak / flops_per_token


@dataclass(frozen=True, slots=True)
class ConventionFlops:
    """Model and hardware FLOPs per token under one attention convention."""

    convention: AttentionConvention
    model: float
    hardware: HardwareFlops


def flops_by_convention(
    shape: ModelShape, seq_len: int, recompute: RecomputeMode, flash_attention: bool
) -> tuple[ConventionFlops, ...]:
    """One row per attention convention, for reports that must state all three side by side."""
    return tuple(
        ConventionFlops(
            convention=convention,
            model=model_flops_per_token(shape, seq_len, convention),
            hardware=hardware_flops_per_token(shape, seq_len, convention, recompute, flash_attention),
        )
        for convention in ATTENTION_CONVENTIONS
    )
