"""``tessera up``: the local platform (what ``make run`` starts)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import typer

from tessera.local.platform import LocalPlatform, LocalPlatformOptions


def up(
    model: Path = typer.Option(None, help="Serve this Hugging Face model directory instead of the small model."),
    engines: int = typer.Option(1, min=1, help="Engine replicas."),
    port: int = typer.Option(8000, help="Gateway port."),
    workers: int = typer.Option(2, min=1, help="Gateway worker processes."),
    policy: str = typer.Option("prefix_affinity", help="Routing policy."),
    state_dir: Path = typer.Option(Path(".tessera"), help="Local state directory."),
) -> None:
    """Start embedded Redis, Ray Serve engines and the gateway; create a demo tenant; wait for Ctrl-C."""
    platform = LocalPlatform(LocalPlatformOptions(state_dir=state_dir, model_dir=model, num_engines=engines,
                                                  gateway_port=port, gateway_workers=workers, routing_policy=policy))
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        platform.start()
        import asyncio

        key = asyncio.run(platform.create_tenant("demo"))
        assert platform.engine_config is not None
        name = platform.engine_config.served_model_name
        typer.echo(f"""
Tessera is up: gateway {platform.base_url}, {engines} engine replica(s) serving '{name}'.
Demo tenant key (shown once): {key}

  curl -N {platform.base_url}/v1/chat/completions \\
    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\
    -d '{{"model": "{name}", "messages": [{{"role": "user", "content": "Hello"}}], "max_tokens": 32, "stream": true}}'

Manage tenants: .venv/bin/tessera tenants --help     Stop: Ctrl-C
""", color=False)
        stop.wait()
    finally:
        typer.echo("[tessera] shutting down")
        platform.stop()
