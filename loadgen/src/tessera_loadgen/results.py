"""The run directory: a versioned JSON result, per-request JSONL, and a CSV summary.

Layout of ``RUN_DIR``::

    result.json      format/version, metric-definitions version, workload (keys redacted), run facts, summary
    requests.jsonl   one line per request (warm-up included and flagged), times relative to the run start
    summary.csv      one row per group (overall, tenant, tenant x class), percentiles as columns
    plots/           PNGs (``plots.py``)
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from tessera_loadgen._version import __version__
from tessera_loadgen.metrics import LATENCY_METRICS, METRICS_VERSION, PERCENTILES, PROMPT_LENGTH_TOLERANCE
from tessera_loadgen.records import RequestRecord

RESULT_FORMAT = "tessera-loadgen-result"
RESULT_FORMAT_VERSION = 1
RESULT_FILE = "result.json"
REQUESTS_FILE = "requests.jsonl"
SUMMARY_FILE = "summary.csv"

PROMPT_LENGTHS_TOKENS = "tokens"
"""Synthetic prompt lengths were asked in the served model's tokens (its tokenizer was known)."""
PROMPT_LENGTHS_APPROXIMATE = "approximate"
"""Some synthetic prompt lengths were asked in words, not the model's tokens (no tokenizer)."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    """Facts about a run that are not metrics."""

    target: str
    started_at_unix: float
    duration_s: float
    num_workers: int
    models: dict[str, str]
    interrupted: bool = False
    num_connects: int = 0
    prompt_lengths: str = PROMPT_LENGTHS_APPROXIMATE
    tokenizers: dict[str, str | None] | None = None


def build_result(workload: dict[str, Any], info: RunInfo, summary: dict[str, Any]) -> dict[str, Any]:
    """The ``result.json`` document."""
    started = dt.datetime.fromtimestamp(info.started_at_unix, tz=dt.UTC)
    return {
        "format": RESULT_FORMAT,
        "format_version": RESULT_FORMAT_VERSION,
        "metrics_version": METRICS_VERSION,
        "metrics_definitions": "docs/loadgen.md#metric-definitions",
        "tool": {"name": "tessera-loadgen", "version": __version__},
        "run": {
            "target": info.target,
            "started_at": started.isoformat(),
            "duration_s": info.duration_s,
            "num_workers": info.num_workers,
            "models": info.models,
            "interrupted": info.interrupted,
            "num_connections_opened": info.num_connects,
            "prompt_lengths": info.prompt_lengths,
            "tokenizers": info.tokenizers or {},
        },
        "workload": workload,
        "summary": summary,
    }


def write_run_dir(run_dir: Path, result: dict[str, Any], records: Iterable[RequestRecord], t0: float) -> None:
    """Write ``result.json``, ``requests.jsonl`` and ``summary.csv`` into ``run_dir`` (created if needed)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    write_jsonl(run_dir / REQUESTS_FILE, records, t0)
    write_summary_csv(run_dir / SUMMARY_FILE, result["summary"])


def write_jsonl(path: Path, records: Iterable[RequestRecord], t0: float) -> None:
    encode = msgspec.json.Encoder().encode
    with path.open("wb") as out:
        for record in records:
            out.write(encode(record.to_json(t0)))
            out.write(b"\n")


def read_jsonl(path: Path) -> list[RequestRecord]:
    """Records back from ``requests.jsonl`` (times relative to the run's start)."""
    decode = msgspec.json.Decoder().decode
    with path.open("rb") as src:
        return [RequestRecord.from_json(decode(line)) for line in src if line.strip()]


def load_result(run_dir: Path) -> dict[str, Any]:
    """``result.json`` of a run directory; ``ValueError`` when it is not a result of a known version."""
    data: dict[str, Any] = json.loads((run_dir / RESULT_FILE).read_text())
    if data.get("format") != RESULT_FORMAT or data.get("format_version") != RESULT_FORMAT_VERSION:
        raise ValueError(
            f"{run_dir / RESULT_FILE}: not a {RESULT_FORMAT} v{RESULT_FORMAT_VERSION} file "
            f"(format={data.get('format')!r}, version={data.get('format_version')!r})"
        )
    return data


_STATS = ("count", "mean", *(f"p{p:g}" for p in PERCENTILES), "max")
_SCALARS = (
    "num_requests",
    "num_completed",
    "num_failed",
    "target_rate_rps",
    "offered_rate_rps",
    "achieved_rate_rps",
    "output_throughput_tps",
    "goodput_rps",
    "slo_attainment",
)
_PROMPT_STATS = ("mean", "p50", "p99", "max")


def summary_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat rows: overall, then each tenant followed by its classes."""
    rows = [_row("overall", "", "", summary["overall"])]
    for tenant, tenant_summary in summary["tenants"].items():
        rows.append(_row("tenant", tenant, "", tenant_summary))
        for name, class_summary in tenant_summary["classes"].items():
            rows.append(_row("class", tenant, name, class_summary))
    return rows


def _row(scope: str, tenant: str, request_class: str, group: dict[str, Any]) -> dict[str, Any]:
    row: dict[str, Any] = {"scope": scope, "tenant": tenant, "request_class": request_class}
    row.update({key: group[key] for key in _SCALARS})
    row["errors"] = ";".join(f"{k}={v}" for k, v in group["errors"].items())
    for metric in (*LATENCY_METRICS, "schedule_lag_s"):
        values = group["schedule_lag_s"] if metric == "schedule_lag_s" else group["latency"][metric]
        for stat in _STATS:
            row[f"{metric}_{stat}"] = values[stat]
    lengths = group.get("prompt_tokens") or {}
    for side in ("asked", "achieved"):
        for stat in _PROMPT_STATS:
            row[f"prompt_tokens_{side}_{stat}"] = (lengths.get(side) or {}).get(stat)
    row["prompt_tokens_share_within_tolerance"] = lengths.get("share_within_tolerance")
    return row


def csv_columns() -> Sequence[str]:
    columns = ["scope", "tenant", "request_class", *_SCALARS, "errors"]
    for metric in (*LATENCY_METRICS, "schedule_lag_s"):
        columns.extend(f"{metric}_{stat}" for stat in _STATS)
    for side in ("asked", "achieved"):
        columns.extend(f"prompt_tokens_{side}_{stat}" for stat in _PROMPT_STATS)
    columns.append("prompt_tokens_share_within_tolerance")
    return columns


def write_summary_csv(path: Path, summary: dict[str, Any]) -> None:
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(csv_columns()))
        writer.writeheader()
        for row in summary_rows(summary):
            writer.writerow({k: "" if v is None else v for k, v in row.items()})


def format_table(summary: dict[str, Any]) -> str:
    """A compact text table of the per-tenant results, for the terminal."""
    header = (
        f"{'group':<28} {'reqs':>6} {'ok':>6} {'fail':>5} {'req/s':>8} {'tok/s':>9} {'good':>6} "
        f"{'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} {'p99':>8} {'E2EL p99':>9} {'lag p99':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in summary_rows(summary):
        name = row["scope"] if row["scope"] == "overall" else row["tenant"]
        if row["scope"] == "class":
            name = f"  {row['tenant']}/{row['request_class']}"
        lines.append(
            f"{name[:28]:<28} {row['num_requests']:>6} {row['num_completed']:>6} {row['num_failed']:>5} "
            f"{_num(row['achieved_rate_rps']):>8} {_num(row['output_throughput_tps']):>9} "
            f"{_pct(row['slo_attainment']):>6} "
            f"{_ms(row['ttft_user_s_p50']):>9} {_ms(row['ttft_user_s_p99']):>8} "
            f"{_ms(row['tpot_s_p50']):>9} {_ms(row['tpot_s_p99']):>8} {_ms(row['e2el_user_s_p99']):>9} "
            f"{_ms(row['schedule_lag_s_p99']):>8}"
        )
    lines.append("TTFT and E2EL in the user view (from t_sched); good = SLO attainment.")
    return "\n".join(lines)


def format_prompt_lengths(summary: dict[str, Any], prompt_lengths: str | None) -> str:
    """Asked against achieved prompt tokens per class (the server's ``usage.prompt_tokens``)."""
    unit = "the model's tokens" if prompt_lengths == PROMPT_LENGTHS_TOKENS else "words (approximate: no tokenizer)"
    header = (
        f"{'prompt tokens':<28} {'n':>6} {'asked p50':>10} {'got p50':>9} {'asked mean':>11} {'got mean':>9} "
        f"{'within ' + format(PROMPT_LENGTH_TOLERANCE, '.0%'):>10}"
    )
    lines = [header, "-" * len(header)]
    for row in summary_rows(summary):
        if row["scope"] != "class":
            continue
        lines.append(
            f"{'  ' + row['tenant'] + '/' + row['request_class']:<28.28} "
            f"{_count(summary, row['tenant'], row['request_class']):>6} "
            f"{_num(row['prompt_tokens_asked_p50']):>10} {_num(row['prompt_tokens_achieved_p50']):>9} "
            f"{_num(row['prompt_tokens_asked_mean']):>11} {_num(row['prompt_tokens_achieved_mean']):>9} "
            f"{_pct(row['prompt_tokens_share_within_tolerance']):>10}"
        )
    lines.append(f"asked in {unit}; got = the server's usage.prompt_tokens, completed requests.")
    return "\n".join(lines)


def _count(summary: dict[str, Any], tenant: str, request_class: str) -> int:
    lengths = summary["tenants"][tenant]["classes"][request_class].get("prompt_tokens") or {}
    return int(lengths.get("num_compared", 0))


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}ms"
