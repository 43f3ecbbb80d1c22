"""What else the engine and the gateway were doing while one request waited, from the run's own timelines.

The spans do not carry the engine's queue or the gateway's in-flight count (see ``EngineAttempt`` for the
engine's own numbers when it does), but every request's interval on each engine and at the gateway is in the
trace: requests whose intervals overlap an instant are a real queue depth at that instant, and the tokens
the others computed during a window are the work the engine did instead of (or beside) this request.

All times are one process's wall clock compared with the same process's (an engine's intervals with that
engine's, the gateway's with the gateway's), so clock skew between hosts does not enter.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left, bisect_right
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from tessera.telemetry.timeline import EngineAttempt, RequestTimeline


@dataclass(frozen=True, slots=True)
class TenantLoad:
    """One tenant's requests present during a window, and the tokens computed for them inside it (each
    request's prefill and decode tokens prorated by how much of its prefill and decode falls in the window)."""

    tenant: str
    num_requests: int
    prefill_tokens: int = 0
    decode_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass(frozen=True, slots=True)
class QueueDepth:
    """Requests on an engine at one instant, this one excluded."""

    num_running: int
    num_waiting: int
    source: str  # "engine": the engine span reported it; "traces": overlapping requests of this run

    @property
    def num_total(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True, slots=True)
class _Work:
    """One attempt as an interval on its engine: waiting [arrival, run), running [run, end)."""

    owner: str  # the request's span id, to leave the request itself out
    tenant: str
    arrival_ns: int
    run_ns: int
    first_token_ns: int
    end_ns: int
    computed_tokens: int
    output_tokens: int

    @classmethod
    def of(cls, t: RequestTimeline, a: EngineAttempt) -> _Work:
        end = max(a.arrival_ns, a.finished_ns or a.end_ns)
        run = min(max(a.arrival_ns, a.scheduled_ns or end), end)
        first = min(max(run, a.first_token_ns or end), end)
        return cls(t.span_id, t.tenant, a.arrival_ns, run, first, end, a.computed_tokens, a.output_tokens)


def _overlap(lo: int, hi: int, start: int, end: int) -> float:
    """Share of [lo, hi) inside [start, end]; an empty interval counts whole when it lies inside."""
    if hi <= lo:
        return 1.0 if start <= lo <= end else 0.0
    return max(0, min(hi, end) - max(lo, start)) / (hi - lo)


def loads_by_tenant(rows: Iterable[tuple[str, float, float]]) -> tuple[TenantLoad, ...]:
    """(tenant, prefill tokens, decode tokens) per request → per tenant, the heaviest first."""
    count: dict[str, int] = defaultdict(int)
    prefill: dict[str, float] = defaultdict(float)
    decode: dict[str, float] = defaultdict(float)
    for tenant, p, d in rows:
        count[tenant] += 1
        prefill[tenant] += p
        decode[tenant] += d
    loads = [TenantLoad(k, count[k], round(prefill[k]), round(decode[k])) for k in count]
    return tuple(sorted(loads, key=lambda x: (-x.tokens, -x.num_requests, x.tenant)))


class EngineLoad:
    """Every attempt of the run as an interval on its engine."""

    def __init__(self, timelines: Iterable[RequestTimeline]) -> None:
        rows: dict[str, list[_Work]] = defaultdict(list)
        for t in timelines:
            for a in t.attempts:
                rows[a.engine].append(_Work.of(t, a))
        self._rows = {e: sorted(ws, key=lambda w: w.arrival_ns) for e, ws in rows.items()}
        self._arrivals = {e: [w.arrival_ns for w in ws] for e, ws in self._rows.items()}
        self._runs = {e: sorted(w.run_ns for w in ws) for e, ws in self._rows.items()}
        self._ends = {e: sorted(w.end_ns for w in ws) for e, ws in self._rows.items()}
        self._longest_ns = {e: max(w.end_ns - w.arrival_ns for w in ws) for e, ws in self._rows.items()}
        self._by_owner: dict[tuple[str, str], list[_Work]] = defaultdict(list)
        for e, ws in self._rows.items():
            for w in ws:
                self._by_owner[(e, w.owner)].append(w)
        self._typical_depth: dict[str, float] = {}

    def depth_at(self, engine: str, at_ns: int, owner: str = "") -> QueueDepth:
        """Running and waiting requests at ``at_ns`` (counts of intervals, O(log n)), ``owner`` left out."""
        if engine not in self._rows:
            return QueueDepth(0, 0, "traces")
        arrived = bisect_right(self._arrivals[engine], at_ns)
        running_or_done = bisect_right(self._runs[engine], at_ns)
        done = bisect_right(self._ends[engine], at_ns)
        waiting, running = arrived - running_or_done, running_or_done - done
        for w in self._by_owner.get((engine, owner), ()):
            waiting -= w.arrival_ns <= at_ns < w.run_ns
            running -= w.run_ns <= at_ns < w.end_ns
        return QueueDepth(running, waiting, "traces")

    def typical_depth(self, engine: str) -> float:
        """Median requests on the engine (running + waiting) at the arrivals of the run's requests."""
        if engine not in self._typical_depth:
            depths = [self.depth_at(engine, w.arrival_ns, w.owner).num_total for w in self._rows.get(engine, ())]
            self._typical_depth[engine] = float(statistics.median(depths)) if depths else 0.0
        return self._typical_depth[engine]

    def work_during(self, engine: str, start_ns: int, end_ns: int, owner: str = "") -> tuple[TenantLoad, ...]:
        """Per tenant: the other requests on the engine during [start_ns, end_ns] and the tokens computed for
        them inside it."""
        return loads_by_tenant(
            (w.tenant, w.computed_tokens * _overlap(w.run_ns, w.first_token_ns, start_ns, end_ns),
             w.output_tokens * _overlap(w.first_token_ns, w.end_ns, start_ns, end_ns))
            for w in self._overlapping(engine, start_ns, end_ns, owner))

    def mean_running(self, engine: str, start_ns: int, end_ns: int, owner: str = "") -> float:
        """Time-weighted mean of the other requests running on the engine during the window (the batch this
        request shared, itself not counted)."""
        if end_ns <= start_ns:
            return float(self.depth_at(engine, start_ns, owner).num_running)
        busy = sum(max(0, min(w.end_ns, end_ns) - max(w.run_ns, start_ns))
                   for w in self._overlapping(engine, start_ns, end_ns, owner))
        return busy / (end_ns - start_ns)

    def _overlapping(self, engine: str, start_ns: int, end_ns: int, owner: str) -> Iterator[_Work]:
        rows = self._rows.get(engine)
        if not rows:
            return
        arrivals = self._arrivals[engine]
        lo = bisect_left(arrivals, start_ns - self._longest_ns[engine])
        hi = bisect_right(arrivals, end_ns)
        for w in rows[lo:hi]:
            if w.owner != owner and w.end_ns > start_ns:
                yield w


class GatewayLoad:
    """Every request the gateway(s) handled, as an interval [start, end) with its tenant and prompt tokens.

    The spans do not say which gateway process handled a request, so with several gateways this is their
    total in flight."""

    def __init__(self, timelines: Iterable[RequestTimeline]) -> None:
        rows = sorted((t for t in timelines if t.via_gateway), key=lambda t: t.start_ns)
        self._rows = rows
        self._starts = [t.start_ns for t in rows]
        self._ends = sorted(t.end_ns for t in rows)
        self._longest_ns = max((t.end_ns - t.start_ns for t in rows), default=0)
        self._typical: float | None = None

    def in_flight_at(self, at_ns: int, owner: str = "") -> tuple[TenantLoad, ...]:
        """Per tenant: the requests in flight at the gateway at ``at_ns`` (``owner`` left out), with the
        prompt tokens they carry."""
        lo = bisect_left(self._starts, at_ns - self._longest_ns)
        hi = bisect_right(self._starts, at_ns)
        return loads_by_tenant(
            (t.tenant, float(t.attempts[0].prompt_tokens if t.attempts else 0), 0.0)
            for t in self._rows[lo:hi] if t.span_id != owner and t.end_ns > at_ns)

    def count_at(self, at_ns: int) -> int:
        return bisect_right(self._starts, at_ns) - bisect_right(self._ends, at_ns)

    def typical_in_flight(self) -> float:
        """Median of the other requests in flight when each request arrived."""
        if self._typical is None:
            counts = [max(0, self.count_at(t.start_ns) - 1) for t in self._rows]
            self._typical = float(statistics.median(counts)) if counts else 0.0
        return self._typical
