"""The one way to start the gateway: ``tessera gateway`` (the Helm chart, ``tessera up``, tests, benches).

uvicorn runs ``create_app`` in ``workers`` processes. Their Prometheus metrics are summed across the
processes: each worker writes its samples to files in ``metrics_dir`` (prometheus_client's multiprocess
mode, chosen by ``PROMETHEUS_MULTIPROC_DIR`` before any worker imports it) and ``/metrics`` on any worker
reads them all. The directory is emptied here, before the workers start, because samples left by an earlier
run (a restarted container keeps its emptyDir) would be added to this run's.

Each worker runs ``lean_server.LeanServer``: uvicorn's ``Server`` with a 1 s housekeeping tick, not 0.1 s.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


class GatewayLaunch(BaseModel):
    """How the gateway process listens; everything else comes from ``TESSERA_*`` settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="127.0.0.1", description="Bind address.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port.")
    workers: int = Field(default=1, ge=1, description="Worker processes (uvicorn).")
    log_level: str = Field(default="warning", description="uvicorn log level.")
    timeout_keep_alive_s: int = Field(default=30, ge=1, description="Idle keep-alive connections close after this.")
    metrics_dir: Path | None = Field(
        default=None, description="Where workers keep their metric samples (default: a new temporary directory)."
    )

    def command(self, python: str = sys.executable) -> list[str]:
        """The command line that starts this gateway (the ``tessera`` script beside ``python``)."""
        cmd = [str(Path(python).parent / "tessera"), "gateway", "--host", self.host, "--port", str(self.port),
               "--workers", str(self.workers), "--log-level", self.log_level,
               "--timeout-keep-alive-s", str(self.timeout_keep_alive_s)]
        return cmd + (["--metrics-dir", str(self.metrics_dir)] if self.metrics_dir else [])


def prepare_metrics_dir(path: Path | None) -> Path:
    """An empty directory for this run's metric samples (created, or emptied of an earlier run's)."""
    directory = path or Path(tempfile.mkdtemp(prefix="tessera-gateway-metrics-"))
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()
    return directory


def run_gateway(launch: GatewayLaunch) -> None:
    """Serves until SIGTERM/SIGINT, then drains (gateway/drain.py: stop accepting, finish the open streams
    for at most TESSERA_DRAIN_TIMEOUT_S, cut the rest with an error event, settle them, exit).

    What ``uvicorn.run`` does, with ``LeanServer`` as each worker's server. No ``server`` header (it only
    names the software); the ``date`` header stays."""
    os.environ[METRICS_DIR_ENV] = str(prepare_metrics_dir(launch.metrics_dir))
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import multiprocess

    from tessera.gateway.drain import BACKSTOP_AFTER_DEADLINE_S
    from tessera.gateway.lean_server import LeanServer, LeanSupervisor, LeanWorker
    from tessera.settings import load_settings

    # uvicorn's own timeout only backs the drain's cut up (drain.py): it cancels what is left without an
    # answer and without waiting for the cancelled requests to settle.
    backstop_s = math.ceil(load_settings().drain_timeout_s + BACKSTOP_AFTER_DEADLINE_S)

    config = uvicorn.Config("tessera.gateway.app:create_app", factory=True, host=launch.host, port=launch.port,
                            workers=launch.workers, loop="uvloop", http="httptools", access_log=False,
                            server_header=False, log_level=launch.log_level,
                            timeout_keep_alive=launch.timeout_keep_alive_s, timeout_graceful_shutdown=backstop_s)
    if config.workers > 1:
        # NOTE: uvicorn's supervisor builds each worker's Server in ``multiprocess.Process.server`` and names
        # that class directly (at start and on every restart): swapping the class is the one seam it has.
        multiprocess.Process = LeanWorker  # type: ignore[misc]
        LeanSupervisor(config, sockets=[config.bind_socket()]).run()
        return
    config.load_app()
    server = LeanServer(config=config)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
