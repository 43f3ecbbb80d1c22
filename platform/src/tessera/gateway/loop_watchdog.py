"""A gateway worker whose event loop stops turning ends itself, so that a fresh worker takes its place.

Why: a worker whose loop is stuck (a deadlock on a lock its own thread holds, as the collector's pause
callback once caused, docs/performance.md section 11; or code that never yields) neither answers nor closes
its connections, and every connection the kernel hands it hangs. Nothing noticed it: uvicorn's supervisor
pings each worker, but the worker answers from a thread of its own, so a stuck loop still looks alive; and
the pod's liveness probe reaches whichever worker accepts its connection, so it fails only now and then.

How: the worker's server tick (``lean_server``, every two seconds, or one where the limit is under 8 s) notes
the time (``beat``). A thread outside the loop compares it with the clock (``check``): with several workers,
the thread that answers the supervisor's pings (``LeanWorker.pong``; no new wake-ups); with one worker, a
thread of its own; either every ``check_period_s`` (a quarter of the limit, at most 2.5 s). When the last beat
is older than ``TESSERA_LOOP_STALL_LIMIT_S``, it writes every thread's stack to stderr (where the loop is stuck:
the log says what to fix) and ends the process with ``STALLED_EXIT_CODE``.
uvicorn's supervisor then starts a new worker; a one-worker gateway exits and Kubernetes restarts its
container. The streams the worker held are cut as a SIGKILL would cut them, and billed the same way (the
settler charges them from the engines' records once their lease lapses: docs/kubernetes.md "Durability").

Armed from the first tick until shutdown begins: the drain has a deadline of its own (``drain.py``).
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import NoReturn

# EX_SOFTWARE: not uvicorn's STARTUP_FAILURE (3), which would stop the supervisor instead of replacing the worker.
STALLED_EXIT_CODE = 70
# The checks come a quarter of the limit apart, and at most this far, seconds: each is a wake-up of a thread
# (~100-170 µs of CPU after a pause on this project's VMs), so no more often than a stall must be caught.
MAX_CHECK_PERIOD_S = 2.5


def check_period_s(limit_s: float) -> float:
    """How far apart the checks come for ``limit_s`` (0: no limit, checks for other reasons at the most).
    Always under half the limit: ``beat_to_judge`` takes a longer gap for a starved process."""
    return MAX_CHECK_PERIOD_S if limit_s <= 0 else min(MAX_CHECK_PERIOD_S, limit_s / 4)


def is_stalled(last_beat: float | None, now: float, limit_s: float) -> bool:
    """Whether a loop that last beat at ``last_beat`` (None: not armed) is stuck at ``now``; a limit of 0 never."""
    return limit_s > 0 and last_beat is not None and now - last_beat > limit_s


def beat_to_judge(last_beat: float | None, last_check: float | None, now: float, limit_s: float) -> float | None:
    """The beat the loop is judged by: its last one, or ``now`` when the checking thread itself had not run
    for more than half the limit. Then the whole process was off the CPU (a machine loaded enough to starve
    it: seen for 1-10 s on this project's 2-core test machines), and the loop had no chance to beat either;
    it gets a full limit from here. A stuck loop is still caught: its checker keeps running on time."""
    if last_beat is None or last_check is None or now - last_check <= limit_s / 2:
        return last_beat
    return max(last_beat, now)


def end_stalled_process(stalled_s: float, limit_s: float) -> NoReturn:
    """Says why on stderr, with every thread's stack, and exits at once (no cleanup: the loop that would run
    it is the one that is stuck)."""
    sys.stderr.write(
        f"tessera gateway worker {os.getpid()}: its event loop has not turned for {stalled_s:.1f} s "
        f"(TESSERA_LOOP_STALL_LIMIT_S={limit_s:g}); every thread's stack follows, the main thread's shows where "
        f"it is stuck. Exiting with {STALLED_EXIT_CODE} so that a fresh worker takes its place.\n")
    sys.stderr.flush()
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(STALLED_EXIT_CODE)


class LoopWatchdog:
    """``beat`` from the loop, ``check`` from any other thread. ``on_stall(stalled_s, limit_s)`` is called
    once per stall (``end_stalled_process`` in a gateway; tests pass a recorder)."""

    def __init__(self, limit_s: float, on_stall: Callable[[float, float], None] = end_stalled_process,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self._on_stall = on_stall
        self._clock = clock
        self._last_beat: float | None = None
        self._last_check: float | None = None

    @property
    def armed(self) -> bool:
        return self._last_beat is not None

    def beat(self) -> None:
        self._last_beat = self._clock()

    def disarm(self) -> None:
        self._last_beat = None

    def check(self) -> bool:
        """True when the loop was found stuck (``on_stall`` has run)."""
        now, seen = self._clock(), self._last_beat
        last_beat = beat_to_judge(seen, self._last_check, now, self.limit_s)
        self._last_check = now
        if last_beat != seen and self._last_beat is seen:  # (not disarmed meanwhile by the loop's thread)
            self._last_beat = last_beat  # the process was starved: the limit starts again now
        if not is_stalled(last_beat, now, self.limit_s):
            return False
        assert last_beat is not None
        self._last_beat = None  # one report per stall, should on_stall return
        self._on_stall(now - last_beat, self.limit_s)
        return True

    def watch_in_thread(self) -> Callable[[], None]:
        """Checks from a daemon thread of its own, every ``check_period_s``; returns the function that stops it."""
        stop = threading.Event()
        period_s = check_period_s(self.limit_s)

        def watch() -> None:
            while not stop.wait(period_s):
                self.check()

        if self.limit_s > 0:
            threading.Thread(target=watch, name="tessera-loop-watchdog", daemon=True).start()
        return stop.set


__all__ = ["MAX_CHECK_PERIOD_S", "STALLED_EXIT_CODE", "LoopWatchdog", "beat_to_judge", "check_period_s",
           "end_stalled_process", "is_stalled"]
