"""Python's garbage collector in Tessera's long-running processes: the startup heap frozen, every pause counted.

A full (generation 2) collection walks every tracked object the process holds. What a process imports at start
dominates that count: an engine replica (vLLM, torch, transformers, Ray) holds ~650,000 tracked objects, and
one full collection of them took ~420 ms on the 2-core CI machine (a gateway worker: ~60,000 objects, ~45 ms).
While it runs the process's event loop stands still, so every request it relays waits: these are the lone
outliers of a TTFT p99. vLLM's own OpenAI server avoids this by freezing its heap once started
(``gc.freeze()``: the objects alive then move to a permanent generation no collection walks); a process that
hosts vLLM without that server must do the same: Ray Serve freezes each replica's heap once its constructor
returns (``RAY_SERVE_FREEZE_GC_ON_STARTUP``, on by default), so an engine replica under Serve is covered; the
engine hosted by ``tessera engine``, the gateway's workers and the KV controller call this module.

``freeze_startup_heap`` is called once a process has started and warmed up; what it allocates afterwards is
collected as usual. ``GcPauses`` times each collection (``gc.callbacks``) and keeps a histogram per
generation, which the process's ``/metrics`` serve as ``tessera_gc_pause_seconds``: an operator looking at a
slow p99 can see whether the collector was the cause. docs/performance.md §11 has the measurements.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

# Upper bounds of the pause histogram, seconds: generation 0 takes microseconds, a full collection of an
# unfrozen engine replica hundreds of milliseconds.
PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
FROZEN_METRIC_NAME = "tessera_gc_frozen_objects"
FROZEN_METRIC_HELP = "Objects in the collector's permanent generation (the startup heap frozen; 0 if it was not)"
METRIC_NAME = "tessera_gc_pause_seconds"
METRIC_HELP = ("Time the Python garbage collector held this process, per collection, by generation (the "
               "startup heap is frozen, so a full collection walks only what was allocated since)")
# Set to 0 to leave the heap unfrozen (to measure what freezing buys: make bench-soak reports the pauses).
FREEZE_ENV = "TESSERA_GC_FREEZE"
# The young generation's threshold once started (Python's default: 700 allocations net of frees). A gateway request
# allocates a few thousand tracked objects, nearly all freed by reference counting within the request, so at 700
# the collector walked the young generation several times a request for little to free; at 20,000 about once
# every few requests. Side by side at bench-stack's 4 req/s pace: ~0.4 ms a request less of the gateway's ~3.7-4.1
# (docs/performance.md, section 9). The cyclic garbage it lets wait is bounded by the threshold (a few MB).
# ``TESSERA_GC_YOUNG_THRESHOLD`` sets another (700: Python's).
YOUNG_THRESHOLD = 20_000
YOUNG_THRESHOLD_ENV = "TESSERA_GC_YOUNG_THRESHOLD"
# Pauses kept for an exporter between two of its takes (a process collects generation 0 a few hundred times
# a second under load; the gateway takes them every server tick).
MAX_PENDING_PAUSES = 10_000


# How many objects the startup freeze moved to the permanent generation, counted once (``note_frozen_heap``).
# NOTE: ``gc.get_freeze_count()`` is not a stored number: it walks the permanent generation's list, ~50 ms for
# an engine replica's ~700,000 frozen objects, with the interpreter held. Called per /metrics scrape it stalled
# the replica's event loop, and every stream it relayed, for those 50 ms at each scrape (make bench-soak saw
# its slowest requests at each sample; docs/performance.md section 11).
_frozen_at_start: int | None = None


def freeze_startup_heap() -> int:
    """Move every object alive now to the collector's permanent generation; returns how many it holds.

    Collect first, oldest generation last, so garbage of the start-up is freed rather than frozen.
    ``TESSERA_GC_FREEZE=0`` skips it (returns what is frozen: 0, unless something else froze the heap). Either way
    the young generation's threshold becomes ``YOUNG_THRESHOLD`` from here on."""
    raw = os.environ.get(YOUNG_THRESHOLD_ENV, str(YOUNG_THRESHOLD))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{YOUNG_THRESHOLD_ENV}={raw!r}: give the young generation's collection threshold as a "
                         f"whole number of allocations, at least 1 ({YOUNG_THRESHOLD} by default, 700 is Python's)")
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(int(raw), older, oldest)
    if os.environ.get(FREEZE_ENV, "1") == "0":
        return note_frozen_heap()
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()
    return note_frozen_heap()


def note_frozen_heap() -> int:
    """Count the permanent generation now (O(its size): call it once, where the process has just frozen its
    heap, before it serves) and keep the count for ``frozen_objects``."""
    global _frozen_at_start
    _frozen_at_start = gc.get_freeze_count()
    return _frozen_at_start


def frozen_objects() -> int:
    """The count ``note_frozen_heap`` kept (counted now and kept, the one time, where nothing noted it: the
    objects frozen later, or freed since, are not followed)."""
    return note_frozen_heap() if _frozen_at_start is None else _frozen_at_start


@dataclass(slots=True)
class GenerationPauses:
    """Cumulative pause histogram of one generation (Prometheus layout: counts per upper bound, +Inf last)."""

    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(PAUSE_BUCKETS_S) + 1))
    num_collections: int = 0
    total_s: float = 0.0

    def add(self, pause_s: float) -> None:
        self.num_collections += 1
        self.total_s += pause_s
        for index, bound in enumerate(PAUSE_BUCKETS_S):
            if pause_s <= bound:
                self.bucket_counts[index] += 1
                return
        self.bucket_counts[-1] += 1


class GcPauses(Collector):
    """Times each collection of this process; a Prometheus collector of what it saw.

    The callback runs inside the collector, which any allocation of any code can start — including code
    that holds a lock: prometheus_client's multiprocess values share one non-reentrant lock, and a new
    labelled child allocates while holding it. So the callback takes no lock and calls nothing that may: it
    counts in plain lists, and with ``keep_pending`` also keeps each pause for ordinary code to export later
    (``take_pending``; the gateway's workers write them to their multiprocess histogram on their server
    tick). NOTE: a callback that observed into that histogram directly deadlocked the gateway's event loop
    on its own lock (a worker that neither answered nor closed connections: the e2e and tenancy failures of
    issue #16's stops 26-27)."""

    def __init__(self, keep_pending: bool = False) -> None:
        self.generations = [GenerationPauses() for _ in range(3)]
        self._pending: list[tuple[int, float]] | None = [] if keep_pending else None
        self._started_at = 0.0
        self._installed = False

    def keep_pending(self) -> None:
        """From now on keep each pause for ``take_pending``."""
        if self._pending is None:
            self._pending = []

    def take_pending(self) -> list[tuple[int, float]]:
        """The pauses (generation, seconds) seen since the last call, oldest first; at most
        ``MAX_PENDING_PAUSES`` (a caller that stopped taking them loses the newest, never memory)."""
        pending = self._pending
        if not pending:
            return []
        # A collection started by the new list's allocation appends to the old one, which is returned.
        self._pending = []
        return pending

    def install(self) -> GcPauses:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        # NOTE: runs at every collection (generation 0 several times per request), so it does the least it can.
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        pause_s = time.perf_counter() - self._started_at
        generation = info["generation"]
        self.generations[generation].add(pause_s)
        pending = self._pending
        if pending is not None and len(pending) < MAX_PENDING_PAUSES:
            pending.append((generation, pause_s))

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        yield GaugeMetricFamily(FROZEN_METRIC_NAME, FROZEN_METRIC_HELP, value=frozen_objects())
        family = HistogramMetricFamily(METRIC_NAME, METRIC_HELP, labels=["generation"])
        for generation, pauses in enumerate(self.generations):
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*PAUSE_BUCKETS_S, float("inf")), pauses.bucket_counts, strict=True):
                cumulative += count
                buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
            family.add_metric([str(generation)], buckets, pauses.total_s)
        yield family


_process_pauses: GcPauses | None = None


def process_gc_pauses(keep_pending: bool = False) -> GcPauses:
    """This process's one ``GcPauses``, installed on first use (a collector times a process, not an object);
    ``keep_pending``: its pauses are kept for ``take_pending`` as well."""
    global _process_pauses
    if _process_pauses is None:
        _process_pauses = GcPauses(keep_pending).install()
    elif keep_pending:
        _process_pauses.keep_pending()
    return _process_pauses
