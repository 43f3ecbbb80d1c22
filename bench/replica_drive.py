"""Driving replicas from a benchmark's own client, shared by bench_routing.py and the fleet bench
(bench/fleet/drive.py): an open-loop replay of a request sequence at its arrival times, the reader of a
replica's ``/generate`` stream (the replica protocol's NDJSON lines: ``t`` tokens, one ``done`` with the
engine's stats, or an ``error``), and the in-flight table the benches' router instances share as one gateway
pod's workers do.

Open loop: each request is sent at its scheduled time whether or not earlier ones have finished, so a slow
policy meets the same arrivals as a fast one and its queueing shows in its TTFTs.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import orjson


class Scheduled(Protocol):
    @property
    def arrival_s(self) -> float: ...


RequestT = TypeVar("RequestT", bound=Scheduled)
OutcomeT = TypeVar("OutcomeT")


async def replay(requests: Sequence[RequestT], one: Callable[[RequestT, float, float], Coroutine[Any, Any, OutcomeT]],
                 time_scale: float = 1.0, lead_s: float = 0.3) -> list[OutcomeT]:
    """Sends each request at ``start + arrival_s * time_scale`` (perf_counter seconds; ``start`` is ``lead_s``
    from now, time to create the first tasks); ``one(request, scheduled, start)`` returns its outcome.
    Outcomes in request order."""
    start = time.perf_counter() + lead_s
    tasks: list[asyncio.Task[OutcomeT]] = []
    for request in requests:
        scheduled = start + request.arrival_s * time_scale
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request, scheduled, start)))
    return list(await asyncio.gather(*tasks))


@dataclass(slots=True)
class GenerateStream:
    """What a ``/generate`` stream said: when its first token arrived (perf_counter seconds; None if none
    did), the ``done`` line's stats, and the ``error`` line's message if it ended with one."""

    first_token_s: float | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


async def read_generate_stream(lines: Any, on_first: Callable[[], None] | None = None) -> GenerateStream:
    """Reads a ``/generate`` response body (an async iterator of NDJSON lines, aiohttp's ``resp.content``)
    up to its end or its first ``error`` line; ``on_first`` is called at the first token."""
    out = GenerateStream()
    async for line in lines:
        message = orjson.loads(line)
        if "t" in message and out.first_token_s is None:
            out.first_token_s = time.perf_counter()
            if on_first is not None:
                on_first()
        elif message.get("done"):
            out.stats = message["stats"]
        elif "error" in message:
            out.error = str(message["error"])
            break
    return out


@contextlib.contextmanager
def one_pod(num_workers: int) -> Iterator[list[Any]]:
    """``num_workers`` rows of one in-flight table (routing/pod_in_flight.py), one per router instance standing
    for a gateway worker, as ``tessera gateway --workers N`` gives its workers; released on exit."""
    from tessera.routing import pod_in_flight

    directory = Path(tempfile.mkdtemp(prefix="bench-pod-"))
    table = directory / "pod-in-flight.table"
    pod_in_flight.create(table, num_workers)
    rows = [pod_in_flight.PodInFlight.attach(table) for _ in range(num_workers)]
    try:
        yield rows
    finally:
        for row in rows:
            if row is not None:
                row.close()
        shutil.rmtree(directory, ignore_errors=True)
