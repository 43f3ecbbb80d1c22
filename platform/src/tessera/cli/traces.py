"""``tessera traces …``: reading the spans a run exported."""

from __future__ import annotations

import json
from pathlib import Path

import typer

traces_app = typer.Typer(no_args_is_help=True, help="Explain tail latency from exported traces.")


@traces_app.command("analyze")
def analyze_cmd(
    source: Path = typer.Argument(..., help="A run directory (every *.jsonl under it) or one JSONL span file."),
    percentile: float = typer.Option(99.0, "--percentile", "-p", help="Select requests at or above this percentile."),
    metric: str = typer.Option("ttft", "--metric", "-m", help="Latency to rank by: ttft or e2e."),
    scope: str = typer.Option("tenant", "--scope", help="Percentile per 'tenant' (default) or over 'all' requests."),
    as_json: bool = typer.Option(False, "--json", help="Print the full report as JSON, evidence included."),
) -> None:
    """Attribute the requests above a latency percentile to causes: gateway queueing, admission wait,
    engine queueing, prefill recompute after a prefix eviction, preemption, slow prefill/decode and
    speculative rejection. Every cause comes with its evidence in numbers (queue depths, tokens computed
    against the engine's typical time, evictions and who caused them, the other tenants' load) and names
    the other tenant behind a request's excess when the evidence points at one."""
    from tessera.telemetry.analyze import AnalysisOptions, analyze, render

    try:
        options = AnalysisOptions(percentile=percentile, metric=metric, scope=scope)  # type: ignore[arg-type]
        report = analyze([source], options)
    except (ValueError, FileNotFoundError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
    else:
        typer.echo(render(report))
