"""JSON-object options (``--policy``, ``--engine-config``, ...): parsed once, with one kind of error."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer


def json_object(text: str | None, source: str, what: str = "a JSON object") -> dict[str, Any] | None:
    """``text`` as a JSON object (``@path`` reads a file); exits 2 naming ``source`` when it is not one."""
    if not text:
        return None
    if text.startswith("@"):
        text = Path(text[1:]).read_text()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        typer.echo(f"error: {source} is not valid JSON: {exc}", err=True)
        raise typer.Exit(2) from None
    if not isinstance(value, dict):
        typer.echo(f"error: {source} must be {what}", err=True)
        raise typer.Exit(2)
    return value
