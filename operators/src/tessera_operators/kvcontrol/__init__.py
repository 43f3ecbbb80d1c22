"""The KV-eviction controller: one control loop per engine (see docs/tracing.md).

``ledger`` keeps per-tenant KV blocks from the engine's own KV events, ``policy`` decides (a pure function
over a snapshot), ``loop`` is the I/O around them, ``controller`` finds the engines, ``metrics`` and
``spans`` are what it reports. Entry point: ``tessera-kvcontrol``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
from collections.abc import Sequence
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .controller import KVController
    from .ledger import UNKNOWN, UNSALTED, Eviction, KVLedger, LedgerUpdate
    from .policy import (
        Abort,
        Action,
        ClearPressure,
        ControlSnapshot,
        Demote,
        InFlightRequest,
        PolicyConfig,
        Restore,
        SetPressure,
        TenantUsage,
        decide,
    )
    from .settings import KVControlSettings

# NOTE: the public names are loaded on first use (PEP 562), not when the package is imported: the entry
# point lives here, and ``tessera-kvcontrol --help`` should not pay for the Redis client (which pulls
# OpenTelemetry), Prometheus and the HTTP client. Name -> the submodule that defines it.
_EXPORTS: dict[str, str] = {
    "KVController": "controller",
    "run_forever": "controller",
    "UNKNOWN": "ledger",
    "UNSALTED": "ledger",
    "Eviction": "ledger",
    "KVLedger": "ledger",
    "LedgerUpdate": "ledger",
    "Abort": "policy",
    "Action": "policy",
    "ClearPressure": "policy",
    "ControlSnapshot": "policy",
    "Demote": "policy",
    "InFlightRequest": "policy",
    "PolicyConfig": "policy",
    "Restore": "policy",
    "SetPressure": "policy",
    "TenantUsage": "policy",
    "decide": "policy",
    "KVControlSettings": "settings",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "UNKNOWN",
    "UNSALTED",
    "Abort",
    "Action",
    "ClearPressure",
    "ControlSnapshot",
    "Demote",
    "Eviction",
    "InFlightRequest",
    "KVControlSettings",
    "KVController",
    "KVLedger",
    "LedgerUpdate",
    "PolicyConfig",
    "Restore",
    "SetPressure",
    "TenantUsage",
    "decide",
    "main",
]


def _parse(argv: Sequence[str] | None) -> KVControlSettings:
    parser = argparse.ArgumentParser(prog="tessera-kvcontrol", description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", help="Redis URL (default: TESSERA_REDIS_URL)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus port (default 9400; 0: none)")
    parser.add_argument("--poll-interval", type=float, help="seconds between polls of each engine")
    parser.add_argument("--model", help="control only the engines serving this model")
    parser.add_argument("--policy", help="PolicyConfig as JSON, e.g. '{\"highWatermark\": 0.85}'")
    parser.add_argument("--observe-only", action="store_true", default=None, help="ledger and spans, no actions")
    parser.add_argument("--shard", type=int, help="this process's shard, from 0 (default: TESSERA_KVCONTROL_SHARD)")
    parser.add_argument("--shards", type=int, help="how many controller processes share the engines (default 1)")
    args = parser.parse_args(argv)
    from .settings import KVControlSettings

    overrides = {
        "redis_url": args.redis_url, "kvcontrol_metrics_port": args.metrics_port,
        "kvcontrol_poll_interval_s": args.poll_interval, "kvcontrol_model": args.model,
        "kvcontrol_policy": json.loads(args.policy) if args.policy else None,
        "kvcontrol_observe_only": args.observe_only, "kvcontrol_shard": args.shard,
        "kvcontrol_shards": args.shards,
    }
    return KVControlSettings(**{k: v for k, v in overrides.items() if v is not None})


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point ``tessera-kvcontrol``: runs until SIGTERM/SIGINT, then releases every flag it holds."""
    settings = _parse(argv)
    from .controller import run_forever

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("tessera_operators.kvcontrol").setLevel(settings.kvcontrol_log_level.upper())

    async def _run() -> None:
        task = asyncio.create_task(run_forever(settings))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, task.cancel)
        try:
            await task
        except asyncio.CancelledError:
            pass
        finally:
            from tessera.telemetry.tracing import flush_tracing

            flush_tracing()

    asyncio.run(_run())
