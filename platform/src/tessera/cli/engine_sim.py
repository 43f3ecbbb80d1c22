"""``tessera engine sim``: a fleet of simulated engine replicas in this process (engine/sim/).

Each replica serves the replica protocol and a minimal OpenAI API on its own port, publishes KV events in
vLLM's wire format, and — with TESSERA_REDIS_URL set — registers, heartbeats and feeds the prefix index as
a real replica does, so gateways route to it unchanged.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from tessera.settings import TesseraSettings


def require_data_plane_key(settings: TesseraSettings, who: str) -> None:
    """Exits with the reason when there is no usable data-plane key: a replica never serves without one."""
    from tessera.data_plane_auth import DataPlaneKeyError, guard_from_settings

    try:
        guard_from_settings(settings, who)
    except DataPlaneKeyError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None


def sim(
    config: str = typer.Option("{}", help="SimEngineConfig as JSON, or @path to a JSON file (default: H100 + "
                                          "Llama-3-70B TP8 FP8 KV, roofline step times)."),
    num_engines: int = typer.Option(1, min=1, help="Simulated replicas in this process (one port each)."),
    time_scale: float = typer.Option(None, help="Wall seconds per simulated second (overrides the config)."),
    engine_id_prefix: str = typer.Option("sim", help="Registry ids are <prefix>-<run>-<index>."),
    ready_file: Path = typer.Option(None, help="Write the replicas' URLs (a JSON list) here once serving."),
) -> None:
    """Start simulated engine replicas; registers them in TESSERA_REDIS_URL when set."""
    from pydantic import ValidationError

    from tessera.engine.sim.config import SimEngineConfig
    from tessera.engine.sim.fleet import SimFleet
    from tessera.settings import load_settings

    text = Path(config[1:]).read_text() if config.startswith("@") else config
    try:
        raw = json.loads(text)
        if time_scale is not None:
            raw["time_scale"] = time_scale
        sim_config = SimEngineConfig.model_validate(raw)
    except (ValidationError, json.JSONDecodeError) as exc:
        typer.echo(f"error: invalid sim config: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = load_settings()
    require_data_plane_key(settings, "a simulated replica")

    async def run() -> None:
        fleet = await SimFleet(sim_config, num_engines, settings.redis_url or None, engine_id_prefix).start()
        urls = [replica.url for replica in fleet.replicas]
        from tessera.telemetry.gc_heap import freeze_startup_heap, process_gc_pauses

        freeze_startup_heap()  # as a vLLM replica does once started (gc_heap.py)
        process_gc_pauses()
        typer.echo(f"{len(urls)} simulated engines serving {sim_config.served_model_name}: {urls[0]} …", err=True)
        if ready_file is not None:
            ready_file.write_text(json.dumps(urls))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await fleet.stop()

    asyncio.run(run())
