"""How fast this machine runs one fixed piece of work right now: the soak's yardstick for a slow window.

The VMs these benches run on change speed by large factors with nothing else running and no CPU stolen in
``/proc/stat``: on 2026-12-05 the bare relay floor (bench/relay_floor.py) measured 21.6-22.8 µs a line at
06:25 and 36-42 µs from 07:02 to 07:55, and in soak run U every part of the platform, the load generator's
client included, spent 16-35 % more CPU per request in its last window than in its first, p50 and p99 rising
with it. The soak's other columns cannot tell that from a platform getting slower: the CPU outside the
platform and the hypervisor's steal stay at zero. This yardstick can: the same pure-Python work (dict
inserts and a sort, the kind of work the gateway and the engine's scheduler do), timed in CPU time. A window
whose p99 rose by as much as the yardstick's time is the machine's; one whose p99 rose while the yardstick held
is the platform's.

Run V showed that one probe at a window's sample reads the machine at that instant, not over the window (4.86 ms
at window 2's sample, 3.79 at window 3's, while every process spent 18-29 % more CPU per request in window 3
than in window 1). So ``YardstickSampler`` runs one probe every ``every_s`` through the run, in a thread of
the bench (~4 ms of CPU every 10 s: 0.04 % of a core), and a window's figure is the median of the probes
taken since the previous sample (``take``).
"""

from __future__ import annotations

import statistics
import threading
import time

WORK_ITEMS = 20_000
REPEATS = 5


def _fixed_work() -> int:
    table: dict[int, int] = {}
    for i in range(WORK_ITEMS):
        table[i * 7919 % 10_007] = i
    return len(sorted(table.items()))


def fixed_work_ms(repeats: int = REPEATS) -> float:
    """The least CPU time, in milliseconds, this thread took for the fixed work over ``repeats`` runs
    (~4-5 ms each on the Intel Xeon VM, 2026-12-05): the least, since an interruption can only add to a run."""
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time_ns()
        _fixed_work()
        best = min(best, (time.thread_time_ns() - started) / 1e6)
    return best


class YardstickSampler:
    """``fixed_work_ms(repeats=1)`` every ``every_s`` seconds in a daemon thread, from ``start`` to ``stop``;
    ``take`` returns the median of the probes since its last call. The thread inherits its creator's nice value:
    the soak starts it at the lowest priority, so a probe waits for the platform (it measures CPU time, which a
    wait does not change)."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self._probes: list[float] = []
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-yardstick", daemon=True)

    def start(self) -> YardstickSampler:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5.0)

    def take(self) -> float | None:
        """The median of the probes since the last call (None if none was taken)."""
        with self._lock:
            probes, self._probes = self._probes, []
        return statistics.median(probes) if probes else None

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            probe = fixed_work_ms(repeats=1)
            with self._lock:
                self._probes.append(probe)
