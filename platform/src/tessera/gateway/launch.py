"""The one way to start the gateway: ``tessera gateway`` (the Helm chart, ``tessera up``, tests, benches).

uvicorn runs ``create_app`` in ``workers`` processes. Their Prometheus metrics are summed across the
processes: each worker writes its samples to files in ``metrics_dir`` (prometheus_client's multiprocess
mode, chosen by ``PROMETHEUS_MULTIPROC_DIR`` before any worker imports it) and ``/metrics`` on the metrics
port (``metrics_port``, apart from the API: the series name tenants) reads them all, whichever worker
answers. The directory is emptied here, before the workers start, because samples left by an earlier run (a
restarted container keeps its emptyDir) would be added to this run's.

Each worker runs ``lean_server.LeanServer``: uvicorn's ``Server`` with a 1 s housekeeping tick, not 0.1 s, and
each connection ``connection_limits.LimitedHttpToolsProtocol``: uvicorn's httptools protocol within the
``TESSERA_MAX_URL_BYTES``, ``TESSERA_MAX_HEADER_BYTES``, ``TESSERA_HEADER_TIMEOUT_S``,
``TESSERA_MAX_CONNECTIONS_PER_WORKER`` and ``TESSERA_MAX_IN_FLIGHT_PER_WORKER`` limits. With several workers,
their routers share one count of the requests in flight to each engine (``routing/pod_in_flight.py``), a file
made here beside the metric samples.
"""

from __future__ import annotations

import functools
import math
import os
import socket
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
    metrics_port: int | None = Field(
        default=None, ge=1, le=65535,
        description="Port of /metrics (Prometheus, every worker summed), on the same address as the API and "
        "apart from it: the series name tenants. None: the metrics are not served.",
    )

    def command(self, python: str = sys.executable) -> list[str]:
        """The command line that starts this gateway (the ``tessera`` script beside ``python``)."""
        cmd = [str(Path(python).parent / "tessera"), "gateway", "--host", self.host, "--port", str(self.port),
               "--workers", str(self.workers), "--log-level", self.log_level,
               "--timeout-keep-alive-s", str(self.timeout_keep_alive_s)]
        cmd += ["--metrics-port", str(self.metrics_port)] if self.metrics_port else []
        return cmd + (["--metrics-dir", str(self.metrics_dir)] if self.metrics_dir else [])


def prepare_metrics_dir(path: Path | None) -> Path:
    """An empty directory for this run's metric samples (created, or emptied of an earlier run's)."""
    directory = path or Path(tempfile.mkdtemp(prefix="tessera-gateway-metrics-"))
    directory.mkdir(parents=True, exist_ok=True)
    for stale in directory.glob("*.db"):
        stale.unlink()
    return directory


def prepare_pod_table(directory: Path, workers: int) -> Path | None:
    """With several workers, their shared count of requests in flight to each engine (routing/pod_in_flight.py):
    a fresh table of one row per worker in ``directory`` (beside the metric samples: per run, per container),
    named to the workers through the environment they inherit. One worker needs none (None)."""
    from tessera.routing import pod_in_flight

    if workers <= 1:
        os.environ.pop(pod_in_flight.ENV_VAR, None)
        return None
    table = directory / "pod-in-flight.table"
    pod_in_flight.create(table, workers)
    os.environ[pod_in_flight.ENV_VAR] = str(table)
    return table


def bind_listener(host: str, port: int) -> socket.socket:
    """A listening socket as uvicorn binds its own (``Config.bind_socket``): reusable address, inheritable by
    the workers."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_gateway(launch: GatewayLaunch) -> None:
    """Serves until SIGTERM/SIGINT, then drains (gateway/drain.py: stop accepting, finish the open streams
    for at most TESSERA_DRAIN_TIMEOUT_S, cut the rest with an error event, settle them, exit).

    What ``uvicorn.run`` does, with ``LeanServer`` as each worker's server. No ``server`` header (it only
    names the software); the ``date`` header stays."""
    metrics_dir = prepare_metrics_dir(launch.metrics_dir)
    os.environ[METRICS_DIR_ENV] = str(metrics_dir)
    prepare_pod_table(metrics_dir, launch.workers)
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors import multiprocess

    from tessera.gateway.connection_limits import ConnectionLimits, LimitedHttpToolsProtocol
    from tessera.gateway.drain import BACKSTOP_AFTER_DEADLINE_S
    from tessera.gateway.lean_server import LeanServer, LeanSupervisor, LeanWorker
    from tessera.settings import load_settings

    settings = load_settings()
    # uvicorn's own timeout only backs the drain's cut up (drain.py): it cancels what is left without an
    # answer and without waiting for the cancelled requests to settle.
    backstop_s = math.ceil(settings.drain_timeout_s + BACKSTOP_AFTER_DEADLINE_S)
    limits = ConnectionLimits(max_url_bytes=settings.max_url_bytes, max_header_bytes=settings.max_header_bytes,
                              header_timeout_s=settings.header_timeout_s,
                              max_connections=settings.max_connections_per_worker,
                              max_in_flight=settings.max_in_flight_per_worker)
    # NOTE: uvicorn builds each connection's protocol as ``http(config=..., server_state=..., app_state=...)``:
    # a partial binds the limits, and pickles to the workers (a class made here would not).
    protocol = functools.partial(LimitedHttpToolsProtocol, limits=limits, metrics_port=launch.metrics_port)
    # proxy_headers off: uvicorn's default wraps the app in a middleware that rewrites the client address from
    # X-Forwarded-For for peers at 127.0.0.1, on every request; nothing in the gateway reads the client address.
    config = uvicorn.Config("tessera.gateway.app:create_app", factory=True, host=launch.host, port=launch.port,
                            workers=launch.workers, loop="uvloop", http=protocol,  # type: ignore[arg-type]
                            ws="none", access_log=False, server_header=False, log_level=launch.log_level,
                            timeout_keep_alive=launch.timeout_keep_alive_s, timeout_graceful_shutdown=backstop_s,
                            proxy_headers=False)
    sockets = [config.bind_socket()]
    if launch.metrics_port is not None:
        sockets.append(bind_listener(launch.host, launch.metrics_port))
    if config.workers > 1:
        # NOTE: uvicorn's supervisor builds each worker's Server in ``multiprocess.Process.server`` and names
        # that class directly (at start and on every restart): swapping the class is the one seam it has.
        multiprocess.Process = LeanWorker  # type: ignore[misc]
        LeanSupervisor(config, sockets=sockets).run()
        return
    config.load_app()
    server = LeanServer(config=config)
    server.run(sockets=sockets)
    if not server.started:
        sys.exit(STARTUP_FAILURE)
