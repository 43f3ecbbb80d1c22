"""An engine's typical prefill time for a given number of computed tokens, from the same run's requests.

Prefill time grows with the tokens to compute (prompt minus cached), so "slow" only means something against
requests of about the same length on the same engine. The reference requests are grouped by length in
powers of two; each group gives a point (median tokens, median seconds), and a length between two points is
interpolated. Medians, not a least-squares line: the reference set still holds requests slowed by their
neighbours, and a run's lengths are often two clusters (a cached prompt computes a few tokens, a cold one a
thousand) where a line through pairwise slopes is dominated by noise inside each cluster.

Below the shortest group the curve is flat (a short prefill is dominated by the step's fixed cost); above
the longest it continues the last segment's slope, and with a single group there is no estimate beyond it.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ALL_ENGINES = "all engines"
MIN_GROUP_REQUESTS = 3  # a group of fewer requests is used only when no group has this many


@dataclass(frozen=True, slots=True)
class TypicalPrefill:
    seconds: float
    num_requests: int  # reference requests in the groups the estimate comes from
    scope: str  # the engine, or ALL_ENGINES when that engine had no reference requests


@dataclass(frozen=True, slots=True)
class _Point:
    tokens: float
    seconds: float
    num_requests: int


def _points(samples: Sequence[tuple[int, float]]) -> tuple[_Point, ...]:
    groups: dict[int, list[tuple[int, float]]] = defaultdict(list)
    for tokens, seconds in samples:
        groups[max(1, tokens).bit_length()].append((tokens, seconds))
    full = {k: v for k, v in groups.items() if len(v) >= MIN_GROUP_REQUESTS} or groups
    return tuple(
        _Point(float(statistics.median(t for t, _ in rows)), float(statistics.median(s for _, s in rows)), len(rows))
        for _, rows in sorted(full.items()))


def _at(points: Sequence[_Point], tokens: int) -> TypicalPrefill | None:
    if not points:
        return None
    if tokens <= points[0].tokens:
        return TypicalPrefill(points[0].seconds, points[0].num_requests, "")
    for lo, hi in itertools.pairwise(points):
        if tokens <= hi.tokens:
            share = (tokens - lo.tokens) / max(hi.tokens - lo.tokens, 1e-9)
            return TypicalPrefill(lo.seconds + share * (hi.seconds - lo.seconds), lo.num_requests + hi.num_requests,
                                  "")
    if len(points) < 2:
        return None
    lo, hi = points[-2], points[-1]
    slope = max(0.0, (hi.seconds - lo.seconds) / max(hi.tokens - lo.tokens, 1e-9))
    return TypicalPrefill(hi.seconds + slope * (tokens - hi.tokens), lo.num_requests + hi.num_requests, "")


class PrefillCurves:
    """One curve per engine and one over all engines (the fallback)."""

    def __init__(self, samples: Iterable[tuple[str, int, float]]) -> None:
        """``samples``: (engine, computed tokens, prefill seconds) of the reference requests."""
        by_engine: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for engine, tokens, seconds in samples:
            by_engine[engine].append((tokens, seconds))
        self._points = {e: _points(rows) for e, rows in by_engine.items()}
        self._all = _points([row for rows in by_engine.values() for row in rows])

    def typical(self, engine: str, tokens: int) -> TypicalPrefill | None:
        own = _at(self._points.get(engine, ()), tokens)
        if own is not None:
            return TypicalPrefill(own.seconds, own.num_requests, engine)
        pooled = _at(self._all, tokens)
        return TypicalPrefill(pooled.seconds, pooled.num_requests, ALL_ENGINES) if pooled is not None else None
