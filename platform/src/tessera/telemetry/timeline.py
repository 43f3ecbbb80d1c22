"""From spans to per-request timelines and eviction records (the analyzer's inputs).

A request is a ``gateway.request`` span with its ``admission``, ``route`` and ``engine.call`` children and
the ``engine.generate`` span(s) under ``engine.call`` (one per engine tried: a request the controller
aborted continues on another engine under the same ``engine.call``). Runs without a gateway still work:
an ``engine.generate`` span without a gateway parent is a request of its own.

Evictions are the controller's ``kvcontrol.eviction`` spans, one record per ``evicted_prefix`` event.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from tessera.telemetry.spanfile import SpanRecord


def _s(ns: int) -> float:
    return ns / 1e9


@dataclass(frozen=True, slots=True)
class EngineAttempt:
    """One ``engine.generate`` span: the engine's own timeline of the request (wall-clock ns)."""

    engine: str
    request_id: str
    start_ns: int
    end_ns: int
    arrival_ns: int
    scheduled_ns: int | None
    first_token_ns: int | None
    finished_ns: int | None
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    preemptions: int
    spec_accepted_tokens: int
    steps: int
    priority: int
    aborted: str | None
    spec_draft_tokens: int = 0
    # The engine's own queue depth when the request arrived, when its span carries it (else the analyzer
    # counts the run's overlapping requests on the engine).
    num_running_at_arrival: int | None = None
    num_waiting_at_arrival: int | None = None

    @property
    def computed_tokens(self) -> int:
        """Prompt tokens the engine had to compute (not served from its prefix cache)."""
        return max(0, self.prompt_tokens - self.cached_tokens)

    @classmethod
    def from_span(cls, span: SpanRecord) -> EngineAttempt:
        def at(name: str) -> int | None:
            event = span.event(name)
            return event.ts_ns if event else None

        def count(key: str) -> int | None:
            value = span.attr(key)
            return int(value) if value is not None else None

        return cls(
            engine=str(span.attr("tessera.engine", "")), request_id=str(span.attr("tessera.request_id", "")),
            start_ns=span.start_ns, end_ns=span.end_ns, arrival_ns=at("queued") or span.start_ns,
            scheduled_ns=at("scheduled"), first_token_ns=at("first_token"), finished_ns=at("finished"),
            prompt_tokens=int(span.attr("gen_ai.usage.input_tokens", 0)),
            cached_tokens=int(span.attr("tessera.cached_tokens", 0)),
            output_tokens=int(span.attr("gen_ai.usage.output_tokens", 0)),
            preemptions=int(span.attr("tessera.preemptions", 0)),
            spec_accepted_tokens=int(span.attr("tessera.spec.accepted_tokens", 0)),
            steps=int(span.attr("tessera.engine.steps", 0)), priority=int(span.attr("tessera.priority", 0)),
            aborted=span.attr("tessera.aborted"),
            spec_draft_tokens=int(span.attr("tessera.spec.draft_tokens", 0)),
            num_running_at_arrival=count("tessera.engine.num_running"),
            num_waiting_at_arrival=count("tessera.engine.num_waiting"),
        )


@dataclass(frozen=True, slots=True)
class RequestTimeline:
    trace_id: str
    span_id: str
    request_id: str
    tenant: str
    start_ns: int
    end_ns: int
    first_token_ns: int | None
    admission_ns: tuple[int, int] | None
    prefix_root: str
    prompt_blocks: int
    attempts: tuple[EngineAttempt, ...]
    rejected: str | None = None
    via_gateway: bool = True  # False: an engine span without a gateway parent (an engine-only run)

    @property
    def ttft_s(self) -> float | None:
        return _s(self.first_token_ns - self.start_ns) if self.first_token_ns else None

    @property
    def e2e_s(self) -> float:
        return _s(self.end_ns - self.start_ns)

    @property
    def engine(self) -> str:
        return self.attempts[-1].engine if self.attempts else ""

    def metric(self, name: str) -> float | None:
        if name == "ttft":
            return self.ttft_s
        if name == "e2e":
            return self.e2e_s if self.first_token_ns else None
        raise ValueError(f"unknown metric {name!r}; valid: ttft, e2e")


@dataclass(frozen=True, slots=True)
class EvictionRecord:
    """Blocks of one prefix chain that the controller saw an engine evict."""

    engine: str
    tenant: str
    ts_ns: int
    prefix_root: str
    depth_min: int
    depth_max: int
    num_blocks: int
    evicted_by: str
    cause: str
    block_size: int


def build_timelines(spans: Iterable[SpanRecord]) -> list[RequestTimeline]:
    by_id: dict[str, SpanRecord] = {}
    children: dict[str, list[SpanRecord]] = defaultdict(list)
    spans = list(spans)
    for span in spans:
        by_id[span.span_id] = span
        if span.parent_span_id:
            children[span.parent_span_id].append(span)
    timelines: list[RequestTimeline] = []
    claimed: set[str] = set()
    for span in spans:
        if span.name != "gateway.request":
            continue
        kids = children.get(span.span_id, [])
        admission = next((k for k in kids if k.name == "admission"), None)
        route = next((k for k in kids if k.name == "route"), None)
        attempts: list[EngineAttempt] = []
        for call in (k for k in kids if k.name == "engine.call"):
            for engine_span in children.get(call.span_id, []):
                if engine_span.name == "engine.generate":
                    attempts.append(EngineAttempt.from_span(engine_span))
                    claimed.add(engine_span.span_id)
        attempts.sort(key=lambda a: a.start_ns)
        first = span.event("first_token")
        first_ns = first.ts_ns if first else next((a.first_token_ns for a in attempts if a.first_token_ns), None)
        timelines.append(RequestTimeline(
            trace_id=span.trace_id, span_id=span.span_id, request_id=str(span.attr("tessera.request_id", "")),
            tenant=str(span.attr("tessera.tenant", "")), start_ns=span.start_ns, end_ns=span.end_ns,
            first_token_ns=first_ns,
            admission_ns=(admission.start_ns, admission.end_ns) if admission else None,
            prefix_root=str(route.attr("tessera.prefix_root", "")) if route else "",
            prompt_blocks=int(route.attr("tessera.prompt_blocks", 0)) if route else 0,
            attempts=tuple(attempts), rejected=span.attr("tessera.rejected"),
        ))
    for span in spans:
        parent = by_id.get(span.parent_span_id or "")
        if span.name != "engine.generate" or span.span_id in claimed or (parent and parent.name == "engine.call"):
            continue
        attempt = EngineAttempt.from_span(span)
        timelines.append(RequestTimeline(
            trace_id=span.trace_id, span_id=span.span_id, request_id=attempt.request_id,
            tenant=str(span.attr("tessera.tenant", "")), start_ns=attempt.arrival_ns, end_ns=span.end_ns,
            first_token_ns=attempt.first_token_ns, admission_ns=None, prefix_root="", prompt_blocks=0,
            attempts=(attempt,), via_gateway=False,
        ))
    return timelines


def build_evictions(spans: Iterable[SpanRecord]) -> list[EvictionRecord]:
    records: list[EvictionRecord] = []
    for span in spans:
        if span.name != "kvcontrol.eviction":
            continue
        for event in span.events:
            if event.name != "evicted_prefix":
                continue
            a = event.attributes
            records.append(EvictionRecord(
                engine=str(span.attr("tessera.engine", "")), tenant=str(span.attr("tessera.tenant", "")),
                ts_ns=event.ts_ns, prefix_root=str(a.get("tessera.kv.prefix_root", "")),
                depth_min=int(a.get("tessera.kv.depth_min", 0)), depth_max=int(a.get("tessera.kv.depth_max", 0)),
                num_blocks=int(a.get("tessera.kv.blocks", 0)), evicted_by=str(span.attr("tessera.kv.evicted_by", "")),
                cause=str(span.attr("tessera.cause", "")), block_size=int(span.attr("tessera.kv.block_size", 0)),
            ))
    records.sort(key=lambda r: r.ts_ns)
    return records
