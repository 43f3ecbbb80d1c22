"""How fast this machine runs one fixed piece of work right now: the soak's yardstick for a slow window.

The VMs these benches run on change speed by large factors with nothing else running and no CPU stolen in
``/proc/stat``: on 2026-12-05 the bare relay floor (bench/relay_floor.py) measured 21.6-22.8 µs a line at
06:25 and 36-42 µs from 07:02 to 07:55, and in soak run U every part of the platform, the load generator's
client included, spent 16-35 % more CPU per request in its last window than in its first, p50 and p99 rising
with it. The soak's other columns cannot tell that from a platform getting slower: the CPU outside the
platform and the hypervisor's steal stay at zero. This yardstick can: the same pure-Python work (dict
inserts and a sort, the kind of work the gateway and the engine's scheduler do), timed in CPU time, least of
a few runs, sampled with each window's other figures. A window whose p99 rose by as much as the yardstick's
time is the machine's; one whose p99 rose while the yardstick held is the platform's.
"""

from __future__ import annotations

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
    (~5-10 ms each here): the least, since an interruption can only add to a run."""
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time_ns()
        _fixed_work()
        best = min(best, (time.thread_time_ns() - started) / 1e6)
    return best
