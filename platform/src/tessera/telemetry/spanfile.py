"""Reading exported spans back: the JSONL files ``tracing.JsonlSpanExporter`` writes (``span_to_dict``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson


@dataclass(frozen=True, slots=True)
class SpanEvent:
    name: str
    ts_ns: int
    attributes: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SpanRecord:
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: tuple[SpanEvent, ...] = ()
    links: tuple[tuple[str, str], ...] = ()  # (trace_id, span_id)

    def attr(self, key: str, default: Any = None) -> Any:
        return self.attributes.get(key, default)

    def event(self, name: str) -> SpanEvent | None:
        for event in self.events:
            if event.name == name:
                return event
        return None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpanRecord:
        return cls(
            trace_id=raw["trace_id"], span_id=raw["span_id"], parent_span_id=raw.get("parent_span_id"),
            name=raw["name"], service=raw.get("service") or "", start_ns=int(raw["start_ns"]),
            end_ns=int(raw.get("end_ns") or raw["start_ns"]), attributes=dict(raw.get("attributes") or {}),
            events=tuple(SpanEvent(e["name"], int(e["ts_ns"]), dict(e.get("attributes") or {}))
                         for e in raw.get("events") or ()),
            links=tuple((link["trace_id"], link["span_id"]) for link in raw.get("links") or ()),
        )


def span_files(paths: Iterable[Path]) -> list[Path]:
    """``*.jsonl`` files: a file as given, a directory searched recursively."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(path.rglob("*.jsonl")))
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"{path} does not exist")
    return files


def iter_spans(paths: Iterable[Path]) -> Iterator[SpanRecord]:
    """Every span in the files; lines that are not spans (other JSONL in a run directory) are skipped."""
    for path in span_files(paths):
        with open(path, "rb") as handle:
            for line in handle:
                if not line.strip():
                    continue
                try:
                    raw = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue  # a line cut short by a process killed mid-write
                if isinstance(raw, dict) and "span_id" in raw and "trace_id" in raw and "name" in raw:
                    yield SpanRecord.from_dict(raw)


def load_spans(paths: Iterable[Path]) -> list[SpanRecord]:
    return list(iter_spans(paths))
