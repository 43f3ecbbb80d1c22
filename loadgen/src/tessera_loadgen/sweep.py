"""Rate sweeps: run a workload at increasing total rates until it saturates or misses its SLOs.

Every point scales the open-loop tenants' rates to the point's total rate, keeping their mix (closed-loop
tenants run unchanged as background). A point *meets the SLOs* when every tenant that has an SLO reaches
its attainment target; it is *saturated* when the achieved request rate falls below
``saturation_fraction`` of the target rate, when the client itself lagged (schedule-lag p99 above
``CLIENT_LAG_LIMIT_S``), or when requests failed outright. The answer of a sweep is the highest rate
whose point, and every point below it, met the SLOs without saturating.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tessera_loadgen.workload import Workload

DEFAULT_SATURATION_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """One rate of a sweep and what it showed."""

    rate_rps: float
    run_dir: str
    achieved_rate_rps: float | None
    goodput_rps: float | None
    slo_attainment: float | None
    ttft_user_p99_s: float | None
    e2el_user_p99_s: float | None
    schedule_lag_p99_s: float | None
    num_failed: int
    meets_slo: bool
    saturated: bool

    @property
    def ok(self) -> bool:
        return self.meets_slo and not self.saturated


def geometric_rates(start_rps: float, factor: float, max_rps: float) -> list[float]:
    """``start, start*factor, ...`` up to and including ``max_rps``."""
    if start_rps <= 0 or factor <= 1 or max_rps < start_rps:
        raise ValueError(f"need 0 < start ({start_rps}) <= max ({max_rps}) and factor ({factor}) > 1")
    count = math.floor(math.log(max_rps / start_rps, factor) + 1e-9) + 1
    return [round(start_rps * factor**i, 6) for i in range(count)]


def evaluate(
    rate_rps: float,
    run_dir: str,
    summary: dict[str, Any],
    workload: Workload,
    saturation_fraction: float = DEFAULT_SATURATION_FRACTION,
) -> SweepPoint:
    """Judge one point from its summary (pure)."""
    overall = summary["overall"]
    meets = True
    for tenant in workload.tenants:
        tenant_summary = summary["tenants"].get(tenant.name)
        slos = [tenant.slo_for(c) for c in tenant.classes]
        targets = [s.attainment_target for s in slos if s is not None]
        if not targets or tenant_summary is None:
            continue
        attainment = tenant_summary["slo_attainment"]
        if attainment is None or attainment < max(targets):
            meets = False
    achieved = overall["achieved_rate_rps"]
    target = overall["target_rate_rps"]
    saturated = (
        (target is not None and (achieved is None or achieved < saturation_fraction * target))
        or bool(overall["client_lagging"])
        or overall["num_completed"] == 0
    )
    latency = overall["latency"]
    return SweepPoint(
        rate_rps=rate_rps,
        run_dir=run_dir,
        achieved_rate_rps=achieved,
        goodput_rps=overall["goodput_rps"],
        slo_attainment=overall["slo_attainment"],
        ttft_user_p99_s=latency["ttft_user_s"]["p99"],
        e2el_user_p99_s=latency["e2el_user_s"]["p99"],
        schedule_lag_p99_s=overall["schedule_lag_s"]["p99"],
        num_failed=overall["num_failed"],
        meets_slo=meets,
        saturated=saturated,
    )


def max_good_rate(points: Sequence[SweepPoint]) -> float | None:
    """The highest rate such that it and every lower rate were ok; ``None`` if the lowest failed."""
    best = None
    for point in sorted(points, key=lambda p: p.rate_rps):
        if not point.ok:
            break
        best = point.rate_rps
    return best


def run_sweep(
    workload: Workload,
    rates: Sequence[float],
    out_dir: Path,
    run_point: Callable[[Workload, Path], dict[str, Any]],
    *,
    refine_steps: int = 0,
    saturation_fraction: float = DEFAULT_SATURATION_FRACTION,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> tuple[list[SweepPoint], float | None]:
    """Run the points in order, stop at the first that fails, then bisect ``refine_steps`` times between
    the last good rate and the first bad one. ``run_point(workload, run_dir)`` returns a run's summary.
    Writes ``sweep.json`` and ``sweep.csv`` into ``out_dir``."""
    points: list[SweepPoint] = []

    def measure(rate: float) -> SweepPoint:
        run_dir = out_dir / f"rate-{rate:g}"
        summary = run_point(workload.with_total_rate(rate), run_dir)
        point = evaluate(rate, str(run_dir), summary, workload, saturation_fraction)
        points.append(point)
        if on_point is not None:
            on_point(point)
        return point

    first_bad = None
    for rate in sorted(rates):
        if not measure(rate).ok:
            first_bad = rate
            break
    good = max_good_rate(points)
    for _ in range(refine_steps):
        if first_bad is None or good is None:
            break
        middle = round((good + first_bad) / 2, 6)
        if measure(middle).ok:
            good = middle
        else:
            first_bad = middle
    best = max_good_rate(points)
    write_sweep(out_dir, points, best)
    return points, best


def write_sweep(out_dir: Path, points: Sequence[SweepPoint], best: float | None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [asdict(p) | {"ok": p.ok} for p in sorted(points, key=lambda p: p.rate_rps)]
    (out_dir / "sweep.json").write_text(json.dumps({"max_rate_meeting_slo_rps": best, "points": rows}, indent=2))
    with (out_dir / "sweep.csv").open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]) if rows else ["rate_rps"])
        writer.writeheader()
        writer.writerows(rows)


def format_points(points: Sequence[SweepPoint], best: float | None) -> str:
    """A text table of the sweep."""
    lines = [f"{'rate':>9} {'achieved':>9} {'goodput':>9} {'attain':>7} {'TTFT p99':>9} {'lag p99':>8} {'ok':>3}"]
    for p in sorted(points, key=lambda p: p.rate_rps):
        lines.append(
            f"{p.rate_rps:>9g} {_f(p.achieved_rate_rps):>9} {_f(p.goodput_rps):>9} "
            f"{_pct(p.slo_attainment):>7} {_ms(p.ttft_user_p99_s):>9} {_ms(p.schedule_lag_p99_s):>8} "
            f"{'yes' if p.ok else 'no':>3}"
        )
    lines.append(f"highest rate meeting the SLOs: {'none' if best is None else f'{best:g} req/s'}")
    return "\n".join(lines)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}ms"
