"""``tessera up``: the local platform (what ``make run`` starts)."""

from __future__ import annotations

import asyncio
import signal
import threading
from pathlib import Path

import typer

from tessera.cli.json_args import json_object


def up(
    model: Path = typer.Option(None, help="Serve this Hugging Face model directory instead of the small model."),
    engines: int = typer.Option(1, min=1, help="Engine replicas."),
    port: int = typer.Option(8000, help="Gateway port."),
    workers: int = typer.Option(2, min=1, help="Gateway worker processes."),
    policy: str = typer.Option("prefix_affinity", help="Routing policy."),
    state_dir: Path = typer.Option(Path(".tessera"), help="Local state directory."),
    engine_config: str = typer.Option(
        None, help="EngineConfig settings as JSON (camelCase, as in the chart's values), or @file: "
        "e.g. '{\"kvCacheDtypeStrict\": true}'."),
    kvcontrol: bool = typer.Option(True, help="Run the KV-eviction controller (as the chart does)."),
    kvcontrol_policy: str = typer.Option(
        None, help="The controller's PolicyConfig as JSON, or @file (default: its defaults, as in the chart)."),
    cpu_split: bool = typer.Option(
        True, help="Pin Redis, the gateway and the controller to the last core, Ray and the engines to the others "
        "(on 2 cores to both, their OpenMP threads spinning ~1 ms before they sleep). Measured: about 40 % less "
        "CPU per request on 2 cores; docs/performance.md."),
) -> None:
    """Start embedded Redis, Ray Serve engines, the gateway and the KV-eviction controller; create a demo
    tenant; wait for Ctrl-C."""
    # NOTE: imported here, not at the top: the local platform pulls the Redis client (and OpenTelemetry with
    # it) and httpx, then Ray and vLLM as it starts; no other command needs them.
    from pydantic import ValidationError

    from tessera.local.banner import up_banner
    from tessera.local.platform import LocalPlatform, LocalPlatformOptions, PlatformStartError

    options = LocalPlatformOptions(
        state_dir=state_dir, model_dir=model, num_engines=engines, gateway_port=port, gateway_workers=workers,
        routing_policy=policy, engine_overrides=json_object(engine_config, "--engine-config") or {},
        kvcontrol=kvcontrol, kvcontrol_policy=json_object(kvcontrol_policy, "--kvcontrol-policy"), cpu_split=cpu_split)
    platform = LocalPlatform(options)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    failed = False
    try:
        platform.start()
        key = asyncio.run(platform.create_tenant("demo"))
        typer.echo(up_banner(platform.base_url, platform.model, key, platform.engines(), platform.trace_dir,
                             platform.kvcontrol_metrics_url,
                             platform.redis_data_dir if platform.redis is not None else None,
                             platform.gateway_metrics_url), color=False)
        stop.wait()
    except (PlatformStartError, ValidationError) as exc:
        # The cause in a line or two, not Ray's traceback.
        failed = True
        typer.echo(f"error: Tessera could not start: {exc}", err=True)
        typer.echo("  `.venv/bin/tessera doctor` shows what this machine has and what an engine runs with here.",
                   err=True)
    finally:
        typer.echo("[tessera] shutting down")
        platform.stop()
    if failed:
        raise typer.Exit(1)
