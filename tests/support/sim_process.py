"""A `tessera engine sim` process for a test: started in its own process group with the test's Redis, awaited
until its ready file names its replicas' URLs, stopped with SIGTERM (SIGKILL after 15 s) however the test ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Seconds for the sim process to serve and register: generous, the shared 2-core machine is often busy.
START_TIMEOUT_S = 120.0


@dataclass
class SimProcess:
    process: subprocess.Popen[bytes]
    urls: list[str]


@contextmanager
def running_sim(config: dict[str, Any], num_engines: int, redis_url: str, work: Path) -> Iterator[SimProcess]:
    """``num_engines`` simulated replicas of ``config`` (the sim's JSON config) in one process; its log is
    ``work/sim.log`` (its tail is in the error when it does not start)."""
    ready = work / "ready.json"
    log = open(work / "sim.log", "wb")  # noqa: SIM115 - closed after the process
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "tessera"), "engine", "sim", "--config", json.dumps(config),
         "--num-engines", str(num_engines), "--ready-file", str(ready)],
        env={**os.environ, "TESSERA_REDIS_URL": redis_url}, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sim did not start:\n{(work / 'sim.log').read_text()[-3000:]}")
            time.sleep(0.1)
        yield SimProcess(process, json.loads(ready.read_text()))
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        log.close()
