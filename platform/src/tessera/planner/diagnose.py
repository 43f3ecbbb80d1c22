"""Explain a measured MFU/HFU pair, and flag pairs that no consistent accounting allows.

HFU/MFU is the ratio of the two numerators, since both divide by the same peak and throughput. Under one
attention convention it is ``(model + recompute + FlashAttention score recompute) / model``: at least 1,
and at most what full recomputation allows, about 4/3 (one more forward on top of forward + backward),
a little more at long context once FlashAttention's backward recompute of QKᵀ is counted. A ratio above
that cap cannot come from recomputation: the two numbers were computed under different conventions,
typically MFU from ``6N`` and HFU from a profiler that counts every executed attention FLOP.

The diagnosis tries, within the measurement's rounding:

* every convention with none, selective or full recomputation, or the fraction ``r`` of the forward
  that partial rematerialisation would have to re-run (PaLM's 57.8/46.2 needs r ≈ 3/4), with and
  without FlashAttention's score recompute (consistent explanations);
* every pair of different conventions for the two numerators (mixed explanations).

A given throughput pins the MFU convention: it must reproduce the measured MFU on its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tessera.planner.flops import (
    ATTENTION_CONVENTIONS,
    CONVENTION_LABELS,
    RECOMPUTE_MODES,
    AttentionConvention,
    hardware_flops_per_token,
    model_flops_per_token,
    recompute_flops_per_token,
    tokens_per_s_at,
)
from tessera.planner.hardware import AcceleratorSpec
from tessera.planner.shapes import ModelShape

Verdict = Literal["consistent", "mixed-conventions", "impossible", "unexplained"]


class MeasuredPair(BaseModel):
    """A reported MFU/HFU pair and what is known about the run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mfu_percent: float = Field(gt=0.0, le=100.0, description="Reported model FLOPs utilisation, percent.")
    hfu_percent: float = Field(gt=0.0, description="Reported hardware FLOPs utilisation, percent.")
    seq_len: int = Field(ge=1, description="Training sequence length, tokens.")
    tolerance_points: float = Field(
        default=0.5,
        ge=0.0,
        description="Rounding of the reported numbers, percentage points (0.5 for integers).",
    )
    tokens_per_s_per_gpu: float | None = Field(
        default=None, gt=0.0, description="Measured throughput per GPU, if known: pins the MFU convention."
    )


@dataclass(frozen=True, slots=True)
class Explanation:
    """One accounting under which the pair holds."""

    mfu_convention: AttentionConvention
    hfu_convention: AttentionConvention
    recompute: str
    recompute_fraction: float
    flash_counted: bool
    predicted_ratio: float

    @property
    def consistent(self) -> bool:
        return self.mfu_convention == self.hfu_convention

    def describe(self) -> str:
        work = "no recomputation" if self.recompute == "none" else f"{self.recompute} recomputation"
        if self.flash_counted:
            work += " and FlashAttention's backward recompute of the scores"
        if self.consistent:
            return f"both count {CONVENTION_LABELS[self.mfu_convention]}; HFU adds {work}"
        return (
            f"MFU counts {CONVENTION_LABELS[self.mfu_convention]} while HFU counts executed work under the "
            f"{CONVENTION_LABELS[self.hfu_convention]} convention: forward, backward, {work}"
        )


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """What ``tessera plan diagnose`` reports."""

    pair: MeasuredPair
    measured_ratio: float
    ratio_low: float
    ratio_high: float
    matmul_cap_ratio: float
    consistent_cap_ratio: float
    verdict: Verdict
    explanations: tuple[Explanation, ...]
    best: Explanation
    implied_tokens_per_s_per_gpu: float
    mfu_percent_by_convention: dict[str, float]
    predicted_hfu_percent: float
    summary: tuple[str, ...]


def _ratio_bounds(pair: MeasuredPair) -> tuple[float, float]:
    tol = pair.tolerance_points
    low = (pair.hfu_percent - tol) / (pair.mfu_percent + tol)
    high = (pair.hfu_percent + tol) / max(pair.mfu_percent - tol, 1e-9)
    return low, high


def _named(
    shape: ModelShape, seq_len: int, mfu_c: AttentionConvention, hfu_c: AttentionConvention
) -> list[Explanation]:
    model = model_flops_per_token(shape, seq_len, mfu_c)
    rows = []
    for recompute in RECOMPUTE_MODES:
        for flash in (False, True) if hfu_c != "6N" else (False,):
            if flash and recompute == "selective":
                continue  # the same work as (none, flash): FlashAttention's recompute is the selective one
            hardware = hardware_flops_per_token(shape, seq_len, hfu_c, recompute, flash)
            fraction = recompute_flops_per_token(shape, seq_len, hfu_c, recompute) / max(
                recompute_flops_per_token(shape, seq_len, hfu_c, "full"), 1.0
            )
            rows.append(Explanation(mfu_c, hfu_c, recompute, fraction, flash, hardware.total / model))
    return rows


def _partial(
    shape: ModelShape, seq_len: int, convention: AttentionConvention, ratio: float
) -> list[Explanation]:
    """Partial rematerialisation: the share r of each layer's forward that the measured ratio needs."""
    rows = []
    for flash in (False, True) if convention != "6N" else (False,):
        base = hardware_flops_per_token(shape, seq_len, convention, "none", flash)
        full_forward = recompute_flops_per_token(shape, seq_len, convention, "full")
        fraction = (ratio * base.model - base.total) / full_forward
        if 0.0 < fraction < 1.0:
            rows.append(
                Explanation(convention, convention, f"partial (r={fraction:.2f})", fraction, flash, ratio)
            )
    return rows


def diagnose(shape: ModelShape, gpu: AcceleratorSpec, pair: MeasuredPair) -> Diagnosis:
    """Explain ``pair`` for ``shape`` on ``gpu`` (see the module docstring)."""
    seq_len, peak = pair.seq_len, gpu.peak_flops("bf16")
    ratio = pair.hfu_percent / pair.mfu_percent
    low, high = _ratio_bounds(pair)
    candidates: list[Explanation] = []
    for mfu_c in ATTENTION_CONVENTIONS:
        for hfu_c in ATTENTION_CONVENTIONS:
            candidates.extend(_named(shape, seq_len, mfu_c, hfu_c))
    for convention in ATTENTION_CONVENTIONS:
        candidates.extend(_partial(shape, seq_len, convention, ratio))

    def mfu_matches(convention: AttentionConvention) -> bool:
        if pair.tokens_per_s_per_gpu is None:
            return True
        mfu = 100.0 * pair.tokens_per_s_per_gpu * model_flops_per_token(shape, seq_len, convention) / peak
        return abs(mfu - pair.mfu_percent) <= pair.tolerance_points

    matches = [e for e in candidates if low <= e.predicted_ratio <= high and mfu_matches(e.mfu_convention)]

    def rank(e: Explanation) -> tuple[bool, float]:
        # A named mode (none/selective/full) within rounding beats a fitted partial fraction.
        return e.recompute.startswith("partial"), abs(e.predicted_ratio - ratio)

    consistent = sorted((e for e in matches if e.consistent), key=rank)
    mixed = sorted((e for e in matches if not e.consistent), key=rank)
    caps = [
        hardware_flops_per_token(shape, seq_len, c, "full", c != "6N").ratio_to_model
        for c in ATTENTION_CONVENTIONS
    ]
    matmul_cap = hardware_flops_per_token(shape, seq_len, "6N", "full").ratio_to_model
    verdict: Verdict
    explanations: tuple[Explanation, ...]
    if pair.hfu_percent > 100.0 + pair.tolerance_points:
        verdict, explanations = "impossible", ()
    elif consistent:
        verdict, explanations = "consistent", tuple(consistent + mixed)
    elif mixed:
        verdict, explanations = "mixed-conventions", tuple(mixed)
    else:
        verdict, explanations = "unexplained", ()
    if explanations:
        best = explanations[0]
    else:
        # Nearest accounting, among those whose MFU convention agrees with a measured throughput.
        pool = [e for e in candidates if mfu_matches(e.mfu_convention)] or candidates
        best = min(pool, key=lambda e: abs(e.predicted_ratio - ratio))
    model = model_flops_per_token(shape, seq_len, best.mfu_convention)
    tokens = pair.tokens_per_s_per_gpu or tokens_per_s_at(pair.mfu_percent / 100.0, model, 1, peak)
    by_convention: dict[str, float] = {
        c: 100.0 * tokens * model_flops_per_token(shape, seq_len, c) / peak for c in ATTENTION_CONVENTIONS
    }
    diagnosis = Diagnosis(
        pair=pair,
        measured_ratio=ratio,
        ratio_low=low,
        ratio_high=high,
        matmul_cap_ratio=matmul_cap,
        consistent_cap_ratio=max(caps),
        verdict=verdict,
        explanations=explanations,
        best=best,
        implied_tokens_per_s_per_gpu=tokens,
        mfu_percent_by_convention=by_convention,
        predicted_hfu_percent=pair.mfu_percent * best.predicted_ratio,
        summary=(),
    )
    return _with_summary(diagnosis, shape, gpu)


def _with_summary(d: Diagnosis, shape: ModelShape, gpu: AcceleratorSpec) -> Diagnosis:
    pair = d.pair
    lines = [
        f"{shape.name} on {gpu.name} at {pair.seq_len} tokens: "
        f"HFU/MFU = {pair.hfu_percent:g}/{pair.mfu_percent:g} = "
        f"{d.measured_ratio:.3f} (between {d.ratio_low:.3f} and {d.ratio_high:.3f} allowing "
        f"±{pair.tolerance_points:g} points of rounding).",
        f"Under one consistent convention recomputation adds at most one forward pass: HFU/MFU ≤ "
        f"{d.matmul_cap_ratio:.3f} for the matmuls (4/3, less the embedding and logit layers, which are not "
        "recomputed), "
        f"≤ {d.consistent_cap_ratio:.3f} here counting FlashAttention's backward recompute of the scores.",
    ]
    if d.verdict == "impossible":
        lines.append(
            f"HFU {pair.hfu_percent:g} % exceeds 100 %: no accounting allows it; check the peak used."
        )
    elif d.verdict == "consistent":
        lines.append(f"Consistent: {d.best.describe()} (predicted HFU/MFU {d.best.predicted_ratio:.3f}).")
        if len({e.mfu_convention for e in d.explanations}) > 1 and pair.tokens_per_s_per_gpu is None:
            lines.append("Several conventions fit; a measured throughput (tokens/s per GPU) would pin MFU's.")
    elif d.verdict == "mixed-conventions":
        lines.append(
            "No consistent accounting allows this pair: recomputation alone cannot reach this ratio."
        )
        others = len(d.explanations) - 1
        lines.append(
            f"It reconciles only under mixed conventions; closest{f' of {others + 1}' if others else ''}: "
            f"{d.best.describe()}. Predicted HFU/MFU {d.best.predicted_ratio:.3f}, "
            f"HFU {d.predicted_hfu_percent:.1f} %."
        )
    else:
        lines.append(
            f"No accounting tried reproduces this pair. Nearest: {d.best.describe()} (HFU/MFU "
            f"{d.best.predicted_ratio:.3f}, HFU {d.predicted_hfu_percent:.1f} %); the other "
            f"{pair.hfu_percent - d.predicted_hfu_percent:+.1f} points of HFU need overheads the formulas "
            "leave out (non-matmul kernels, padding, a different peak) or a measurement error."
        )
    by_convention = ", ".join(
        f"{d.mfu_percent_by_convention[c]:.1f} % ({CONVENTION_LABELS[c].split(' ')[0]})"
        for c in ATTENTION_CONVENTIONS
    )
    source = "measured" if pair.tokens_per_s_per_gpu else f"implied by MFU under {d.best.mfu_convention}"
    lines.append(
        f"Throughput {source}: {d.implied_tokens_per_s_per_gpu:.0f} tokens/s per GPU; at that throughput "
        f"MFU is {by_convention}. State the attention convention with every MFU."
    )
    return dataclasses.replace(d, summary=tuple(lines))
