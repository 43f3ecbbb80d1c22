"""Live progress: counters the runner updates, and a one-line display with rate, in-flight and p50/p99.

The runner only increments counters and appends ``(t_done, ttft_user_s, e2el_user_s)`` to a bounded deque
(well under a microsecond per request); percentiles are computed once per display tick over the
completions of the last ``window_s`` seconds.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from tessera_loadgen.records import RequestRecord

Sample = tuple[float, float, float]


class LiveStats:
    """Counters of one process; ``recent`` holds the latest completions (NaN TTFT when there is none)."""

    __slots__ = ("_shipped", "num_done", "num_failed", "num_sent", "recent")

    def __init__(self, max_recent: int = 4096) -> None:
        self.num_sent = 0
        self.num_done = 0
        self.num_failed = 0
        self.recent: deque[Sample] = deque(maxlen=max_recent)
        self._shipped = 0

    @property
    def in_flight(self) -> int:
        return self.num_sent - self.num_done

    def on_sent(self) -> None:
        self.num_sent += 1

    def on_done(self, record: RequestRecord) -> None:
        self.num_done += 1
        if not record.ok:
            self.num_failed += 1
            return
        t_done = record.t_done
        assert t_done is not None
        t_first = record.t_first
        ttft = t_first - record.t_sched if t_first is not None else math.nan
        last = record.t_last if record.t_last is not None else t_done
        self.recent.append((t_done, ttft, last - record.t_sched))

    def new_samples(self) -> list[Sample]:
        """Completions appended since the previous call (for shipping from a worker to the parent)."""
        total = self.num_done - self.num_failed
        fresh = min(total - self._shipped, len(self.recent))
        self._shipped = total
        return list(self.recent)[-fresh:] if fresh > 0 else []


class AggregateStats:
    """The parent's view of several workers: the same attributes as ``LiveStats``."""

    def __init__(self, num_workers: int, max_recent: int = 4096) -> None:
        self._counters = [(0, 0, 0)] * num_workers
        self.recent: deque[Sample] = deque(maxlen=max_recent)

    def update(self, worker: int, counters: tuple[int, int, int], samples: list[Sample]) -> None:
        self._counters[worker] = counters
        self.recent.extend(samples)

    @property
    def num_sent(self) -> int:
        return sum(c[0] for c in self._counters)

    @property
    def num_done(self) -> int:
        return sum(c[1] for c in self._counters)

    @property
    def num_failed(self) -> int:
        return sum(c[2] for c in self._counters)

    @property
    def in_flight(self) -> int:
        return self.num_sent - self.num_done


@dataclass(frozen=True, slots=True)
class ProgressSnapshot:
    elapsed_s: float
    num_sent: int
    num_done: int
    num_failed: int
    in_flight: int
    send_rate_rps: float
    done_rate_rps: float
    ttft_p50_s: float
    ttft_p99_s: float
    e2el_p50_s: float
    e2el_p99_s: float


def snapshot(
    stats: LiveStats | AggregateStats,
    now: float,
    t0: float,
    previous: ProgressSnapshot | None,
    window_s: float = 10.0,
) -> ProgressSnapshot:
    """Counters now, rates since ``previous``, and user-view p50/p99 over the last ``window_s`` seconds."""
    elapsed = now - t0
    if previous is not None and elapsed > previous.elapsed_s:
        dt = elapsed - previous.elapsed_s
        send_rate = (stats.num_sent - previous.num_sent) / dt
        done_rate = (stats.num_done - previous.num_done) / dt
    else:
        send_rate = done_rate = 0.0
    horizon = now - window_s
    window = [s for s in stats.recent if s[0] >= horizon]
    ttft = [s[1] for s in window if not math.isnan(s[1])]
    e2el = [s[2] for s in window]
    t50, t99 = np.percentile(ttft, [50, 99]) if ttft else (math.nan, math.nan)
    e50, e99 = np.percentile(e2el, [50, 99]) if e2el else (math.nan, math.nan)
    return ProgressSnapshot(
        elapsed,
        stats.num_sent,
        stats.num_done,
        stats.num_failed,
        stats.in_flight,
        send_rate,
        done_rate,
        float(t50),
        float(t99),
        float(e50),
        float(e99),
    )


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value * 1000:.0f}ms" if value < 10 else f"{value:.1f}s"


def render(snap: ProgressSnapshot) -> str:
    """One status line."""
    return (
        f"[{snap.elapsed_s:7.1f}s] sent {snap.num_sent} done {snap.num_done} failed {snap.num_failed} "
        f"in-flight {snap.in_flight} | {snap.send_rate_rps:.0f} req/s sent, {snap.done_rate_rps:.0f} done "
        f"| TTFT p50 {_ms(snap.ttft_p50_s)} p99 {_ms(snap.ttft_p99_s)} "
        f"| E2EL p50 {_ms(snap.e2el_p50_s)} p99 {_ms(snap.e2el_p99_s)}"
    )


async def display(
    stats: LiveStats | AggregateStats,
    t0: float,
    stop: asyncio.Event,
    interval_s: float = 1.0,
    stream: TextIO = sys.stderr,
) -> None:
    """Print a status line every ``interval_s`` until ``stop`` is set (in place on a terminal)."""
    tty = stream.isatty()
    previous: ProgressSnapshot | None = None
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
        except TimeoutError:
            pass
        previous = snapshot(stats, time.perf_counter(), t0, previous)
        line = render(previous)
        stream.write(f"\r\x1b[2K{line}" if tty else f"{line}\n")
        stream.flush()
    if tty:
        stream.write("\n")
