"""How long vLLM's processes busy-wait on their shared-memory queues (``EngineConfig.shm_busy_loop_s``).

vLLM 0.32's CPU build always runs the model in a worker process (the multiprocessing executor), fed by a
shared-memory ``MessageQueue`` from the engine-core process and answering through another. A reader of such a
queue spins with ``sched_yield`` for ``SpinCondition.busy_loop_s`` (1 s, not configurable in vLLM) after
each message before it sleeps on a ZMQ socket. While a request runs, the engine core therefore spins as long
as the worker computes and the worker spins while the engine core schedules: each holds a core, which on a
small machine is a core taken from the model's own threads, the gateway and Redis. docs/performance.md has
the measurements behind the default.

vLLM wakes a sleeping reader through a ZMQ PUB/SUB notification with a send high-water mark of 1, which
drops a notification now and then (measured here: with a busy-wait of 0 a request stalled for seconds at a
time, each reader sleeping out vLLM's 5 s recheck interval). So a reader past its busy-wait does not sleep
for vLLM's full interval: for ``WARM_S`` after its last message it rechecks the queue every ``MIN_RECHECK_MS``
(the second vLLM itself spins through, where the next message is likely), then after a quarter of the time it
has been idle. A lost notification costs a millisecond while requests come, and an idle replica still wakes
only a few times a second, then less and less.

The setting travels as the environment variable ``TESSERA_VLLM_SHM_BUSY_LOOP_S`` (the host sets it before
vLLM starts, so every process vLLM forks or spawns inherits it) and is applied in each process by
``install``: in the host's own process (vLLM forks from there outside Ray), and through the vLLM general
plugin ``tessera`` (platform/pyproject.toml), which vLLM loads in every engine-core and worker process it
starts, spawned ones included (inside Ray vLLM spawns).
"""

from __future__ import annotations

import os
import time
from typing import Any

ENV = "TESSERA_VLLM_SHM_BUSY_LOOP_S"
# A sleeping reader rechecks its queue every MIN_RECHECK_MS for WARM_S after its last message, then after
# RECHECK_IDLE_FRACTION of its idle time (vLLM's own recheck interval, 5 s, stays the upper bound). Why the warm
# second: with the quarter rule alone, requests arriving 0.1-0.3 s apart (Poisson at 4 req/s) found their
# readers asleep for 25-75 ms, and a notification lost then cost that much: instrumented on a 2-core VM, 34 of
# ~470 reads after an idle sleep came when the sleep timed out, 5 of them after 38-57 ms
# (docs/performance.md section 7). Rechecking each millisecond costs a few % of a core per reader during the
# second where vLLM's own readers spin a whole core.
MIN_RECHECK_MS = 1
WARM_S = 1.0
RECHECK_IDLE_FRACTION = 0.25


def recheck_ms(idle_s: float, timeout_ms: int | None) -> int | None:
    """How long a reader idle for ``idle_s`` sleeps before it looks at its queue again."""
    quarter_ms = int(idle_s * 1000 * RECHECK_IDLE_FRACTION)
    bound = MIN_RECHECK_MS if idle_s < WARM_S else max(MIN_RECHECK_MS, quarter_ms)
    return bound if timeout_ms is None else min(timeout_ms, bound)


def configured_busy_loop_s() -> float | None:
    """The busy-wait this process's vLLM queues should use, or None where the host set none."""
    raw = os.environ.get(ENV)
    return float(raw) if raw else None


def install() -> None:
    """Caps the busy-wait of every shared-memory queue reader in this process at ``TESSERA_VLLM_SHM_BUSY_LOOP_S``,
    and bounds its sleeps by ``recheck_ms``.

    Idempotent, and a no-op without the variable. The cap is applied when a reader waits rather than when it
    is made, so queues built before this runs (a worker builds its queues before vLLM loads plugins) get it.
    """
    busy_loop_s = configured_busy_loop_s()
    if busy_loop_s is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    condition = shm_broadcast.SpinCondition
    original = getattr(condition.wait, "__tessera_original__", condition.wait)

    def wait(self: Any, timeout_ms: int | None = None) -> None:
        if self.busy_loop_s > busy_loop_s:
            self.busy_loop_s = busy_loop_s
        if self.is_reader:
            timeout_ms = recheck_ms(time.monotonic() - self.last_read, timeout_ms)
        original(self, timeout_ms)

    wait.__tessera_original__ = original  # type: ignore[attr-defined]
    condition.wait = wait  # type: ignore[method-assign]


def vllm_plugin() -> None:
    """Entry point of the vLLM general plugin ``tessera`` (loaded by vLLM in each of its processes)."""
    install()
