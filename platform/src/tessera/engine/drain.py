"""A replica's exit without failing a request: leave the registry first, finish what is open, then stop.

Serve removes a replica (autoscaling down, a redeploy) by calling its destructor and killing its actor
``graceful_shutdown_timeout_s`` later (engine/autoscaling.py ``serve_shutdown_options``). Serve's own drain
cannot help: the gateway streams from the replica's HTTP port, past Serve. So the host drains itself:

1. it leaves the engine registry (no heartbeat after that), so every gateway's next registry read no
   longer offers it;
2. it keeps serving for at least ``registry_max_age_s``, the oldest registry copy a gateway routes from
   (TESSERA_REGISTRY_MAX_AGE_S): a request routed from such a copy still lands on a live endpoint and is
   then waited for like any other;
3. it waits until no request is open, or ``timeout_s`` (EngineConfig.drainTimeoutS) from the start has
   passed, whichever comes first; only then does its HTTP server stop.

Invariant (tests/unit/platform/test_drain.py): the registry is left before the wait starts, and the wait
never ends while a request is open unless the deadline has passed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class DrainOutcome:
    """How a drain ended: ``num_cut`` requests were still open at the deadline (0: drained)."""

    num_cut: int
    waited_s: float

    @property
    def drained(self) -> bool:
        return self.num_cut == 0


async def drain(num_open: Callable[[], int], leave_registry: Callable[[], Awaitable[None]],
                registry_max_age_s: float, timeout_s: float,
                clock: Callable[[], float] = time.monotonic, poll_s: float = POLL_S) -> DrainOutcome:
    """Steps 1-3 above. ``num_open()``: requests open on the endpoint now; ``leave_registry()``: stop the
    heartbeat and delete the registry entry (its errors are the caller's to log, not to stop the drain)."""
    start = clock()
    deadline = start + timeout_s
    # Stale copies may still route here until this long after we left; bounded by the deadline.
    accepting_until = min(start + registry_max_age_s, deadline)
    await leave_registry()
    while True:
        now = clock()
        open_now = num_open()
        if now >= deadline or (now >= accepting_until and open_now == 0):
            return DrainOutcome(num_cut=open_now, waited_s=now - start)
        await asyncio.sleep(poll_s)
