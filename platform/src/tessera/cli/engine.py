"""``tessera engine serve``: one engine host without Ray (benchmarks, debugging, bare-metal replicas).

NOTE: the engine host pulls vLLM, torch and Triton (seconds to import, and Triton's notice on CPU
machines). They are imported when ``serve`` runs, not when the ``tessera`` command is built, so every
other command and ``--help`` stay fast.
"""

from __future__ import annotations

import json
import signal
import threading
from pathlib import Path

import typer

from tessera.cli.engine_sim import require_data_plane_key, sim

engine_app = typer.Typer(no_args_is_help=True, help="Run an engine host directly.")
engine_app.command("sim")(sim)


@engine_app.command("serve")
def serve(
    config: str = typer.Option(..., help="EngineConfig as JSON, or @path to a JSON file."),
    engine_id: str = typer.Option(None, help="Registry id (default: random)."),
    ready_file: Path = typer.Option(None, help="Write the endpoint URL here once serving."),
) -> None:
    """Start one vLLM engine and its streaming endpoint; registers in TESSERA_REDIS_URL when set."""
    from pydantic import ValidationError

    from tessera.engine.config import EngineConfig
    from tessera.settings import load_settings

    text = Path(config[1:]).read_text() if config.startswith("@") else config
    try:
        engine_config = EngineConfig.model_validate(json.loads(text))
    except (ValidationError, json.JSONDecodeError) as exc:
        typer.echo(f"error: invalid engine config: {exc}", err=True)
        raise typer.Exit(2) from None
    settings = load_settings()
    require_data_plane_key(settings, "an engine replica")
    # NOTE: vLLM comes in only now, so a config error is reported without waiting seconds for it.
    from tessera.engine.host import EngineHost

    host = EngineHost(engine_config, settings.redis_url, engine_id=engine_id,
                      advertise_host=settings.advertise_host).start()
    from tessera.telemetry.gc_heap import freeze_startup_heap, process_gc_pauses

    freeze_startup_heap()  # started and warmed up: the startup heap is no full collection's business (gc_heap.py)
    process_gc_pauses()
    typer.echo(f"engine {host.engine_id} serving at {host.url}", err=True)
    if ready_file is not None:
        ready_file.write_text(host.url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    # As a Serve replica leaves (deployment.py): out of the registry first, then the open streams finish
    # (at most drainTimeoutS) before the server stops (engine/drain.py).
    host.drain()
