"""Ray as ``tessera up`` runs it: one node, one engine deployment, and as little background work as Ray allows.

Ray's own periodic work (metrics export, event-loop statistics, the memory monitor, prestarted workers, usage
statistics) runs whether or not anything happens; on a 2-core developer machine it competes with the engine,
the gateway and Redis. docs/performance.md has the idle measurements behind each setting (``bench/
bench_engine_host.py --ray-idle``). Each is one of Ray's own system settings, given as the ``RAY_<name>``
environment variable its processes read at start; a value already in the environment wins.
"""

from __future__ import annotations

import os
from typing import Any

# NOTE: each is safe for a single-node development platform, not necessarily for a cluster: the chart's
# RayService keeps Ray's defaults (metrics export and the memory monitor matter there).
QUIET_RAY_ENV: dict[str, str] = {
    # No Prometheus metrics export from every Ray process (nothing scrapes them under `tessera up`).
    "RAY_enable_metrics_collection": "0",
    "RAY_metrics_report_interval_ms": "60000",
    # Per-handler event-loop timing in every Ray process.
    "RAY_event_stats": "0",
    # The memory monitor reads /proc every 250 ms to kill workers under memory pressure.
    "RAY_memory_monitor_refresh_ms": "0",
    # Idle Python workers started ahead of tasks that `tessera up` never submits (Serve uses actors).
    "RAY_enable_worker_prestart": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_num_prestart_python_workers": "0",
    # Task state events sent to the GCS for the dashboard's task view (the dashboard is off).
    "RAY_task_events_report_interval_ms": "10000",
    "RAY_USAGE_STATS_ENABLED": "0",
    # Serve's controller reconciles every 0.1 s; a replica that dies is still replaced within a second.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0",
    # NOTE: Ray starts its workers at nice 15, and the engine replica is one: vLLM's processes then lose
    # every contended core to anything else on the machine (seen: 5 s to a first token beside other work),
    # where `vllm serve` runs at 0. The engine is the platform's main work: run it at the default priority.
    "RAY_worker_niceness": "0",
}


def quiet_ray_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``QUIET_RAY_ENV`` less what ``environ`` (default: this process's environment) already sets."""
    environ = dict(os.environ) if environ is None else environ
    return {name: value for name, value in QUIET_RAY_ENV.items() if name not in environ}


def ray_init_kwargs(num_cpus: int, env: dict[str, str]) -> dict[str, Any]:
    """``ray.init`` arguments: no dashboard, worker logs not copied to the driver, ``env`` in every worker."""
    return {"num_cpus": num_cpus, "include_dashboard": False, "log_to_driver": False,
            "runtime_env": {"env_vars": env}, "configure_logging": False}
