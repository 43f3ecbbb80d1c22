"""``tessera doctor``: what Tessera sees here and what ``make run`` will run with; non-zero when it cannot."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from tessera.cli.json_args import json_object


def doctor(
    model: Path = typer.Option(None, help="Check this Hugging Face model directory instead of the small model."),
    engine_config: str = typer.Option(
        None, help="EngineConfig overrides as JSON, or @path to a JSON file (e.g. '{\"kvCacheDtypeStrict\": true}')."
    ),
    port: int = typer.Option(8000, help="Gateway port `tessera up` would use."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of lines."),
) -> None:
    """Print the CPU, GPUs, vLLM, Ray, memory, Redis and ports Tessera sees, and the KV dtype, speculative
    method and KV capacity an engine runs with here. Exits 1, naming the cause, when something is missing."""
    from tessera.doctor import diagnose
    from tessera.settings import load_settings

    overrides = json_object(engine_config, "--engine-config") or {}
    findings = diagnose(load_settings().redis_url, port, model, overrides)
    problems = [f for f in findings if f.problem]
    if as_json:
        typer.echo(json.dumps({"ok": not problems,
                               "findings": [{"area": f.area, "seen": f.seen, "problem": f.problem}
                                            for f in findings]}, indent=2))
    else:
        for finding in findings:
            mark = "✗" if finding.problem else "✓"
            typer.echo(f"{mark} {finding.area:<7} {finding.seen}")
            if finding.problem:
                typer.echo(f"          problem: {finding.problem}")
        typer.echo(f"\n{len(problems)} problem(s): Tessera cannot run here until they are fixed." if problems
                   else "\nEverything make run needs is here.")
    if problems:
        raise typer.Exit(1)
