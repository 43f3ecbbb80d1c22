"""The workers' supervisor sleeps until a worker exits, a signal comes, or its ping period ends: a dead worker
is replaced as it exits and a signal handled as it comes, with no wake-up between (uvicorn's looks every
0.5 s)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.supervisors import multiprocess

from tessera.gateway import lean_server
from tessera.gateway.lean_server import LeanSupervisor


class SleepingWorker:
    """A worker as the supervisor sees one (uvicorn's ``multiprocess.Process``): a process that sleeps, whose
    sentinel is a pidfd (readable once it exits)."""

    made: list[SleepingWorker] = []
    pings = 0

    def __init__(self, config: Any, sockets: Any) -> None:
        self.popen = subprocess.Popen(["sleep", "120"])
        self.process = self
        self.sentinel = os.pidfd_open(self.popen.pid)
        SleepingWorker.made.append(self)

    def start(self) -> None:
        pass

    def is_alive(self, timeout: float = 5) -> bool:
        SleepingWorker.pings += 1
        return self.popen.poll() is None

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        self.popen.kill()

    terminate = kill

    def join(self) -> None:
        self.popen.wait()
        os.close(self.sentinel)


@pytest.fixture
def supervisor(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[float], LeanSupervisor]]:
    """Makes a two-worker supervisor of sleeping workers with the given ping period; the signal handlers
    uvicorn installs are put back after."""
    handlers = {sig: signal.getsignal(sig) for sig in multiprocess.SIGNALS}
    monkeypatch.setattr(multiprocess, "Process", SleepingWorker)
    SleepingWorker.made, SleepingWorker.pings = [], 0

    def make(period_s: float) -> LeanSupervisor:
        monkeypatch.setattr(lean_server, "check_period_s", lambda limit_s: period_s)
        return LeanSupervisor(uvicorn.Config(app=lambda *_: None, workers=2), sockets=[])

    yield make
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    for worker in SleepingWorker.made:
        worker.popen.kill()
        worker.popen.wait()


def _in_a_while(delay_s: float, action: Callable[[], None]) -> None:
    threading.Timer(delay_s, action).start()


def test_a_worker_that_exits_is_replaced_at_once_and_a_signal_ends_it_at_once(
        supervisor: Callable[[float], LeanSupervisor]) -> None:
    lean = supervisor(20.0)  # no ping comes before the test's deadlines
    replaced = threading.Event()
    signalled_at: list[float] = []

    def kill_the_first_worker() -> None:
        SleepingWorker.made[0].popen.kill()
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if lean.processes[0] is not SleepingWorker.made[0]:
                replaced.set()
                break
            time.sleep(0.02)
        signalled_at.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's handler queues it; the supervisor wakes to handle it

    _in_a_while(0.5, kill_the_first_worker)
    lean.run()  # returns once SIGTERM was handled
    assert replaced.is_set(), "the dead worker waited for the ping period"
    assert time.monotonic() - signalled_at[0] < 8, "the signal waited for the ping period"
    assert len(SleepingWorker.made) == 3 and lean.processes[0] is SleepingWorker.made[2]
    assert all(worker.popen.poll() is not None for worker in SleepingWorker.made)  # all ended with it


def test_an_idle_supervisor_pings_once_a_period(supervisor: Callable[[float], LeanSupervisor]) -> None:
    lean = supervisor(0.5)
    _in_a_while(1.6, lambda: os.kill(os.getpid(), signal.SIGINT))
    lean.run()
    # Three periods (each pings both workers), and the wake for the signal (both again): never more.
    assert 4 <= SleepingWorker.pings <= 8, SleepingWorker.pings
