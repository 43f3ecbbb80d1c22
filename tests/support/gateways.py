"""Real gateway processes for tests: ``tessera gateway`` (the launch the chart and ``tessera up`` use) on free ports.

Each gateway is its own process group, so ``kill()`` (SIGKILL) and ``stop()`` (SIGTERM, then SIGKILL) reach
exactly the processes this helper started.

NOTE: a process group, not a session (``start_new_session``). With the kernel's autogroup scheduling
(``/proc/sys/kernel/sched_autogroup_enabled``, on here), every session is a scheduling group of its own,
and on this 2-core machine's kernel (6.18, EEVDF) a gateway alone in its group, sharing a core with vLLM's
core-pinned, busy-polling worker threads, was seen runnable yet unscheduled for 1-10 s at a time
(/proc/PID/sched: 2 ms of CPU and one context switch in 4 s; the run queue held it next to the vLLM
threads). Its lease renewals then fired seconds late. In the test's own session it is scheduled fairly.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tessera.gateway.launch import GatewayLaunch
from tests.support.machine import free_port

HEALTH_TIMEOUT_S = 90.0


@dataclass
class GatewayProcess:
    """One gateway process (``workers`` uvicorn workers) listening on ``port``, its metrics on ``metrics_port``."""

    port: int
    process: subprocess.Popen[bytes]
    log_path: Path
    metrics_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        """Where its /metrics is served (apart from the API)."""
        assert self.metrics_port is not None, "started without a metrics port"
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no lifespan shutdown, no finish, no lease release (a crashed gateway)."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self.alive():
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except FileNotFoundError:
            return ""

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"gateway on port {self.port} exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise TimeoutError(f"gateway on port {self.port} not healthy after {timeout_s} s:\n{self.log_tail()}")


def spawn_gateway(redis_url: str, log_dir: Path, env: Mapping[str, str] | None = None, workers: int = 1,
                  port: int | None = None) -> GatewayProcess:
    """Starts one gateway process; call ``wait_healthy()`` before using it."""
    port = port or free_port()
    metrics_port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"gateway-{port}.log"
    # Each gateway its own finish journal, unless the caller shares one (a restart that replays it).
    full_env = {**os.environ, "TESSERA_REDIS_URL": redis_url, "TESSERA_TRACE_EXPORTER": "none",
                "TESSERA_FINISH_JOURNAL_DIR": str(log_dir / f"gateway-{port}-journal"), **(env or {})}
    cmd = GatewayLaunch(port=port, workers=workers, metrics_dir=log_dir / f"gateway-{port}-metrics",
                        metrics_port=metrics_port).command()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT, process_group=0)
    return GatewayProcess(port, process, log_path, metrics_port)


def start_gateways(num: int, redis_url: str, log_dir: Path, env: Mapping[str, str] | None = None,
                   workers: int = 1) -> list[GatewayProcess]:
    """Starts ``num`` gateway processes at once and waits until each answers /health."""
    gateways = [spawn_gateway(redis_url, log_dir, env, workers) for _ in range(num)]
    try:
        for gateway in gateways:
            gateway.wait_healthy()
    except BaseException:
        for gateway in gateways:
            gateway.stop()
        raise
    return gateways


@contextmanager
def running_gateways(num: int, redis_url: str, log_dir: Path, env: Mapping[str, str] | None = None,
                     workers: int = 1) -> Iterator[list[GatewayProcess]]:
    gateways = start_gateways(num, redis_url, log_dir, env, workers)
    try:
        yield gateways
    finally:
        for gateway in gateways:
            gateway.stop()
