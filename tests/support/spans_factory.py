"""Synthetic exported spans (the ``span_to_dict`` format) for the analyzer's unit tests."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

_ids = itertools.count(1)
MS = 1_000_000


def _id(width: int) -> str:
    return f"{next(_ids):0{width}x}"


def span(trace_id: str, name: str, start_ms: float, end_ms: float, parent: str | None = None,
         attributes: dict[str, Any] | None = None, events: list[tuple[str, float, dict[str, Any]]] | None = None,
         service: str = "svc") -> dict[str, Any]:
    return {"trace_id": trace_id, "span_id": _id(16), "parent_span_id": parent, "name": name, "service": service,
            "start_ns": int(start_ms * MS), "end_ns": int(end_ms * MS), "status": "UNSET",
            "attributes": attributes or {},
            "events": [{"name": n, "ts_ns": int(t * MS), "attributes": a} for n, t, a in events or []],
            "links": []}


@dataclass
class Attempt:
    engine: str = "e1"
    arrival: float = 5.0       # ms after the request start
    scheduled: float = 6.0
    first_token: float = 20.0
    finished: float = 60.0
    prompt_tokens: int = 320
    cached_tokens: int = 288
    output_tokens: int = 16
    steps: int = 8
    preemptions: int = 0
    spec_accepted: int = 8
    spec_drafted: int = 0
    aborted: str | None = None


@dataclass
class Req:
    tenant: str = "victim"
    start: float = 0.0          # ms, absolute
    admission: tuple[float, float] = (1.0, 2.0)
    prefix_root: str = "00000000000000aa"
    prompt_blocks: int = 10
    attempts: list[Attempt] = field(default_factory=lambda: [Attempt()])
    end: float | None = None

    def spans(self) -> list[dict[str, Any]]:
        trace = _id(32)
        s0 = self.start
        last = self.attempts[-1]
        end = s0 + (self.end if self.end is not None else last.finished + 1.0)
        first = next(a.first_token for a in self.attempts if a.first_token is not None)
        root = span(trace, "gateway.request", s0, end, attributes={"tessera.tenant": self.tenant,
                                                                    "tessera.request_id": f"req-{trace[-6:]}"},
                    events=[("first_token", s0 + first + 0.5, {})])
        out = [root,
               span(trace, "admission", s0 + self.admission[0], s0 + self.admission[1], root["span_id"]),
               span(trace, "route", s0 + self.admission[1], s0 + self.admission[1] + 0.5, root["span_id"],
                    {"tessera.prefix_root": self.prefix_root, "tessera.prompt_blocks": self.prompt_blocks})]
        call = span(trace, "engine.call", s0 + self.admission[1] + 0.5, end, root["span_id"])
        out.append(call)
        for a in self.attempts:
            events: list[tuple[str, float, dict[str, Any]]] = [("queued", s0 + a.arrival, {}),
                                                               ("scheduled", s0 + a.scheduled, {})]
            if a.first_token is not None:
                events.append(("first_token", s0 + a.first_token, {}))
                events.append(("finished", s0 + a.finished, {}))
            attrs: dict[str, Any] = {
                "tessera.engine": a.engine, "tessera.tenant": self.tenant, "tessera.request_id": "r",
                "gen_ai.usage.input_tokens": a.prompt_tokens, "tessera.cached_tokens": a.cached_tokens,
                "gen_ai.usage.output_tokens": a.output_tokens, "tessera.preemptions": a.preemptions,
                "tessera.spec.accepted_tokens": a.spec_accepted, "tessera.engine.steps": a.steps,
                "tessera.priority": 20}
            if a.aborted:
                attrs["tessera.aborted"] = a.aborted
            if a.spec_drafted:
                attrs["tessera.spec.draft_tokens"] = a.spec_drafted
            out.append(span(trace, "engine.generate", s0 + a.arrival - 0.2, s0 + a.finished, call["span_id"], attrs,
                            events))
        return out


def eviction(engine: str, tenant: str, at_ms: float, root: str, depths: tuple[int, int], blocks: int,
             evicted_by: str = "noisy", block_size: int = 32) -> dict[str, Any]:
    return span(_id(32), "kvcontrol.eviction", at_ms, at_ms, attributes={
        "tessera.engine": engine, "tessera.tenant": tenant, "tessera.cause": "cross_tenant",
        "tessera.kv.blocks": blocks, "tessera.kv.evicted_by": evicted_by, "tessera.kv.block_size": block_size},
        events=[("evicted_prefix", at_ms, {"tessera.kv.prefix_root": root, "tessera.kv.depth_min": depths[0],
                                           "tessera.kv.depth_max": depths[1], "tessera.kv.blocks": blocks})])
