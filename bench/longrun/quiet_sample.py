"""When in a window the soak samples the platform: in the schedule's widest gap near the window's end (pure).

A sample walks every process with psutil and scrapes three ``/metrics``: ~45 ms of machine CPU on two cores.
Taken at the window's boundary, it ran beside whatever requests were in flight there, and in run Q
(docs/performance.md section 10) a window's slowest request (83 ms against a p99 of ~46) was one sent 0.5 s
before the boundary: one tenant's p99, its 4th-5th slowest request of ~410, moved by the sampler alone.

The soak's windows meet the same arrivals (the loadgen's ``arrival.period_s`` is the window), so the bench
knows every arrival in advance: it samples in the widest gap of the window's last ``search_s`` seconds, a
little after the arrival that opens it (``settle_s``, long enough for that request's first token), when no
request is waiting for its first token and none arrives for the longest time. What a sample reads (RSS,
Redis keys, sockets) does not depend on the exact second it is taken.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_SEARCH_S = 60.0
# The soak's TTFT p99 is ~40-50 ms on the 2-core VMs; 150 ms after its arrival a request is streaming.
DEFAULT_SETTLE_S = 0.15


def quiet_sample_offset(arrivals_s: Iterable[float], window_s: float, *, search_s: float = DEFAULT_SEARCH_S,
                        settle_s: float = DEFAULT_SETTLE_S) -> float:
    """Seconds from a window's start at which to sample it.

    ``arrivals_s``: the arrivals of one window, seconds from its start (each in ``[0, window_s)``); the next
    window repeats them, so the last gap runs to the next window's first arrival. The gap chosen is the
    widest whose opening arrival lies in the last ``search_s`` seconds; the sample is ``settle_s`` after that
    arrival, or halfway into a gap shorter than twice that. With no arrival in those seconds, the window's end.
    """
    if window_s <= 0:
        raise ValueError(f"window must be > 0 s, got {window_s}")
    times = sorted(arrivals_s)
    if not times:
        return window_s
    if times[0] < 0 or times[-1] >= window_s:
        raise ValueError(f"arrivals must lie in [0, {window_s}) s")
    after = [*times[1:], times[0] + window_s]
    start = window_s - min(search_s, window_s)
    candidates = [(gap_end - opened, opened) for opened, gap_end in zip(times, after, strict=True) if opened >= start]
    if not candidates:
        return window_s
    width, opened = max(candidates)
    return opened + min(settle_s, width / 2)


def window_arrivals(offsets_s: Iterable[float], *, period_s: float, warmup_s: float) -> list[float]:
    """One window's arrivals, seconds from its start, given the schedule's first period (``offsets_s``, from the
    load's t0, repeated every ``period_s``) and windows that start ``warmup_s`` after t0."""
    return sorted((offset - warmup_s) % period_s for offset in offsets_s if offset < period_s)
