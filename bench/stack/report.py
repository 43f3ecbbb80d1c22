"""From measured phases to the report: percentiles, CPU per request per part, ratios to the vLLM-alone
baseline and the goals beside them. Pure functions over ``PhaseRun`` values; the tables are markdown."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .cpu import PARTS
from .workload import Sample

BASELINE = "vllm"
GOALS = (  # (what, phase or None for every phase, metric, most allowed ratio to the baseline)
    ("E2E p50", None, "e2e_p50_ms", 1.05),
    ("TTFT p99 @4 req/s", "poisson@4", "ttft_p99_ms", 1.2),
    ("CPU per request", None, "cpu_ms_per_request", 1.1),
)


@dataclass
class PhaseRun:
    """One phase of one stack in one round, as measured."""

    stack: str
    phase: str
    round_index: int
    wall_s: float
    samples: list[Sample]
    cpu_s: dict[str, float] = field(default_factory=dict)  # part -> CPU seconds over the phase
    client_cpu_s: float = 0.0
    cpu_by_process_s: dict[str, float] = field(default_factory=dict)  # "part/process name" -> CPU seconds


def percentile_ms(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q) * 1e3) if values else math.nan


def ratio(value: float, base: float) -> float:
    return value / base if base and not math.isnan(base) and not math.isnan(value) else math.nan


def summarize(runs: Sequence[PhaseRun]) -> dict[str, Any]:
    """The runs of one stack and phase (one per round) together: latency percentiles over all their
    successful requests, CPU per request per part over all their requests."""
    samples = [s for run in runs for s in run.samples]
    ok = [s for s in samples if s.ok]
    num_requests = len(samples)
    cpu = {part: sum(run.cpu_s.get(part, 0.0) for run in runs) for part in PARTS}
    cpu = {part: seconds for part, seconds in cpu.items() if seconds > 0 or any(part in r.cpu_s for r in runs)}
    per_request = {part: seconds * 1e3 / num_requests for part, seconds in cpu.items()} if num_requests else {}
    wall_s = sum(run.wall_s for run in runs)
    ttft, e2e = [s.ttft_s for s in ok], [s.e2e_s for s in ok]
    client_cpu_s = sum(r.client_cpu_s for r in runs)
    return {
        "stack": runs[0].stack, "phase": runs[0].phase, "rounds": len(runs), "requests": num_requests,
        "errors": num_requests - len(ok), "achieved_rps": num_requests / wall_s if wall_s else math.nan,
        "ttft_p50_ms": percentile_ms(ttft, 50), "ttft_p99_ms": percentile_ms(ttft, 99),
        "e2e_p50_ms": percentile_ms(e2e, 50), "e2e_p99_ms": percentile_ms(e2e, 99),
        "prompt_tokens_mean": float(np.mean([s.prompt_tokens for s in ok])) if ok else math.nan,
        "completion_tokens_mean": float(np.mean([s.completion_tokens for s in ok])) if ok else math.nan,
        "cpu_ms_per_request_by_part": per_request,
        "cpu_ms_per_request": sum(per_request.values()) if per_request else math.nan,
        # Everything but the engine: what the stack adds around vLLM (its engine loop burns ~a core regardless).
        "added_cpu_ms_per_request": (sum(v for p, v in per_request.items() if p != "engine")
                                     if per_request else math.nan),
        # Cores busy on average: per-request CPU at low rates is mostly what the stack burns while it waits.
        "cpu_cores": sum(cpu.values()) / wall_s if wall_s else math.nan,
        "client_cpu_ms_per_request": client_cpu_s * 1e3 / num_requests if num_requests else math.nan,
        "cpu_ms_per_request_by_process": {
            key: seconds * 1e3 / num_requests for key, seconds in sorted(
                _merge([r.cpu_by_process_s for r in runs]).items(), key=lambda kv: -kv[1])} if num_requests else {},
        "first_errors": sorted({s.error for s in samples if not s.ok})[:3],
    }


def _merge(dicts: Sequence[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for key, value in d.items():
            out[key] = out.get(key, 0.0) + value
    return out


def top_processes(rows: list[dict[str, Any]], stack: str, num: int = 8) -> str:
    """Where ``stack``'s CPU goes, process by process (ms per request), for each phase: a markdown table."""
    mine = [r for r in rows if r["stack"] == stack]
    keys = list(dict.fromkeys(k for r in mine for k in list(r["cpu_ms_per_request_by_process"])[:num]))
    return markdown(["process (part/name)", *(r["phase"] for r in mine)],
                    [[k, *(_f(r["cpu_ms_per_request_by_process"].get(k, math.nan)) for r in mine)] for k in keys])


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its ratios to the baseline's row of the same phase (NaN where the baseline has none)."""
    base = {row["phase"]: row for row in rows if row["stack"] == BASELINE}
    for row in rows:
        b = base.get(row["phase"], {})
        for metric in ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "cpu_ms_per_request"):
            row[f"x_{metric}"] = ratio(row[metric], b.get(metric, math.nan))
    return rows


def goal_checks(rows: list[dict[str, Any]], stack: str = "tessera") -> list[dict[str, Any]]:
    """Each goal for ``stack``, per phase it applies to: the ratio, the limit and whether it is met."""
    checks = []
    for what, only_phase, metric, limit in GOALS:
        for row in rows:
            if row["stack"] != stack or (only_phase and row["phase"] != only_phase):
                continue
            value = row[f"x_{metric}"]
            checks.append({"goal": what, "phase": row["phase"], "ratio": value, "limit": limit,
                           "met": (not math.isnan(value)) and value <= limit})
    return checks


def _f(value: Any, digits: int = 1) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def latency_table(rows: list[dict[str, Any]]) -> str:
    head = ["stack", "phase", "req", "err", "rps", "TTFT p50 ms", "TTFT p99 ms", "E2E p50 ms", "E2E p99 ms",
            "×TTFT p50", "×TTFT p99", "×E2E p50", "×E2E p99", "prompt tok", "out tok"]
    lines = [[r["stack"], r["phase"], r["requests"], r["errors"], _f(r["achieved_rps"], 2), _f(r["ttft_p50_ms"]),
              _f(r["ttft_p99_ms"]), _f(r["e2e_p50_ms"]), _f(r["e2e_p99_ms"]), _f(r["x_ttft_p50_ms"], 2),
              _f(r["x_ttft_p99_ms"], 2), _f(r["x_e2e_p50_ms"], 2), _f(r["x_e2e_p99_ms"], 2),
              _f(r["prompt_tokens_mean"], 0), _f(r["completion_tokens_mean"], 1)] for r in rows]
    return markdown(head, lines)


def cpu_table(rows: list[dict[str, Any]]) -> str:
    parts = [p for p in PARTS if any(p in r["cpu_ms_per_request_by_part"] for r in rows)]
    head = ["stack", "phase", "CPU ms/req", "×CPU", "cores", "not engine", *parts, "client"]
    lines = [[r["stack"], r["phase"], _f(r["cpu_ms_per_request"]), _f(r["x_cpu_ms_per_request"], 2),
              _f(r["cpu_cores"], 2), _f(r["added_cpu_ms_per_request"]),
              *(_f(r["cpu_ms_per_request_by_part"].get(p, math.nan)) for p in parts),
              _f(r["client_cpu_ms_per_request"])] for r in rows]
    return markdown(head, lines)


def goals_table(checks: list[dict[str, Any]]) -> str:
    lines = [[c["goal"], c["phase"], _f(c["ratio"], 2), f"≤ {c['limit']}", "met" if c["met"] else "NOT met"]
             for c in checks]
    return markdown(["Tessera goal", "phase", "ratio to vLLM", "limit", ""], lines)


def markdown(head: Sequence[str], lines: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in line] for line in lines]
    widths = [max(len(h), *(len(line[i]) for line in cells)) if cells else len(h) for i, h in enumerate(head)]
    out = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
           "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += ["| " + " | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) + " |" for line in cells]
    return "\n".join(out)
