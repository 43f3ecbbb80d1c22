"""``tessera gateway``: the gateway's processes, as the chart, ``tessera up``, tests and benches start them."""

from __future__ import annotations

from pathlib import Path

import typer


def gateway(
    host: str = typer.Option("127.0.0.1", help="Bind address (0.0.0.0 in a pod)."),
    port: int = typer.Option(8000, help="Port."),
    workers: int = typer.Option(1, min=1, help="Worker processes; their metrics are summed on /metrics."),
    metrics_port: int = typer.Option(None, min=1, max=65535,
                                     help="Port of /metrics, apart from the API (unset: metrics not served)."),
    log_level: str = typer.Option("warning", help="uvicorn log level."),
    timeout_keep_alive_s: int = typer.Option(30, min=1, help="Idle keep-alive connections close after this."),
    metrics_dir: Path = typer.Option(None, help="Directory for the workers' metric samples (emptied at start)."),
) -> None:
    """Serve the OpenAI-compatible API; settings come from TESSERA_* variables (see tessera.settings)."""
    from tessera.gateway.launch import GatewayLaunch, run_gateway

    run_gateway(GatewayLaunch(host=host, port=port, workers=workers, log_level=log_level,
                              timeout_keep_alive_s=timeout_keep_alive_s, metrics_dir=metrics_dir,
                              metrics_port=metrics_port))
