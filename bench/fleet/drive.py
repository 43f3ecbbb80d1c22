"""Driving one policy over the workload: Tessera's ``Router`` in this process (as bench_routing does, two
router instances standing for two gateway workers, then the chosen replica's own ``/generate``), or an
OpenAI client in front of vllm-router; and a probe of the fleet's event loop while it runs.

Time: arrivals are simulated seconds, sent at ``start + arrival_s * time_scale`` wall seconds; a TTFT is
``(first token - scheduled) / time_scale``. The fleet's clock is scaled the same way, so its step times
and these TTFTs are in the same simulated seconds. What runs in real time (the Python client, Redis,
vllm-router's own work) shrinks by ``time_scale`` in those figures; decision latencies are reported in
real (wall) microseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from replica_drive import one_pod, read_generate_stream, replay
from routing_figures import percentile

from fleet.summary import Outcome
from fleet.workload import FleetRequest

# approx_prefix routes on the prompt's leading characters (the gateway's APPROX_PREFIX_CHARS).
APPROX_PREFIX_CHARS = 4096
PROBE_INTERVAL_S = 0.05


@dataclass
class RunResult:
    outcomes: list[Outcome]
    extra: dict[str, Any] = field(default_factory=dict)


class Errors:
    """Why requests failed: counts by message, the first few kept (a run never stops for one request)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def note(self, why: str) -> None:
        key = why[:200]
        self.counts[key] = self.counts.get(key, 0) + 1

    def top(self, n: int = 5) -> dict[str, int]:
        return dict(sorted(self.counts.items(), key=lambda kv: -kv[1])[:n])


def _session() -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=900))


def _failed(request: FleetRequest, scheduled: float, start: float, time_scale: float) -> Outcome:
    now = time.perf_counter()
    return Outcome((now - scheduled) / time_scale, (now - start) / time_scale, 0, request.num_prompt_tokens, 0,
                   ok=False)


class LoopProbe:
    """Two lateness probes while a run lasts. The fleet's: GET /health of a random replica every
    PROBE_INTERVAL_S — the round trip (wall ms) grows when the fleet's one event loop falls behind, and
    past a step's length times the time scale its latencies include that lag. The client's own: how late
    a PROBE_INTERVAL_S sleep in this loop wakes (the requests it sends are late by as much)."""

    def __init__(self, urls: list[str]) -> None:
        self._urls = urls
        self.rtts_ms: list[float] = []
        self.client_lags_ms: list[float] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def _fleet(self) -> None:
        rng = random.Random(5)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            while True:
                t = time.perf_counter()
                try:
                    async with session.get(f"{rng.choice(self._urls)}/health") as resp:
                        await resp.read()
                    self.rtts_ms.append((time.perf_counter() - t) * 1e3)
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(PROBE_INTERVAL_S)

    async def _client(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(PROBE_INTERVAL_S)
            self.client_lags_ms.append((time.perf_counter() - t - PROBE_INTERVAL_S) * 1e3)

    def __enter__(self) -> LoopProbe:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._fleet()), loop.create_task(self._client())]
        return self

    def __exit__(self, *_: object) -> None:
        for task in self._tasks:
            task.cancel()

    def summary(self) -> dict[str, float]:
        return {"fleet_probe_p50_ms_wall": percentile(self.rtts_ms, 50),
                "fleet_probe_p99_ms_wall": percentile(self.rtts_ms, 99),
                "client_loop_lag_p99_ms_wall": percentile(self.client_lags_ms, 99)}


def index_bytes(index: Any) -> int | None:
    """Bytes a ``LocalPrefixIndex`` holds, by walking it: its tables, each key, and each distinct value
    object once (holder masks are shared objects there). None if its layout is not the one walked here."""
    try:
        holders, extra = index._holders, index._extra
        tables = [holders, extra, index._masks, index._bits, index._slots, index._slot_engine]
    except AttributeError:
        return None
    seen: set[int] = set()
    total = sum(sys.getsizeof(t) for t in tables)
    for key, value in holders.items():
        total += sys.getsizeof(key)
        if id(value) not in seen:
            seen.add(id(value))
            total += sys.getsizeof(value)
    for key, inner in extra.items():
        total += sys.getsizeof(key) + sys.getsizeof(inner)
        total += sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in inner.items())
    return int(total)


async def run_tessera(policy: str, requests: Sequence[FleetRequest], chains: Sequence[tuple[int, ...]],
                      redis_url: str, model: str, time_scale: float, num_workers: int,
                      index_source: str) -> RunResult:
    from _support import signed_headers

    from tessera.redis_conn import connect
    from tessera.routing.prefix_index import PrefixIndex
    from tessera.routing.router import Router
    from tessera.routing.snapshot import RouteRequest

    redis = connect(redis_url, timeout_s=5.0)
    # The workers of one gateway pod share their in-flight counts through the pod's table.
    held = contextlib.ExitStack()
    routers = [Router(redis, policy, PrefixIndex(redis), index_source=index_source, pod=row)
               for row in held.enter_context(one_pod(num_workers))]
    for router in routers:
        await router.start_local_index()
    session = _session()
    errors = Errors()

    async def one(request: FleetRequest, scheduled: float, start: float) -> Outcome:
        router = routers[request.worker]
        try:
            # A registry read that is due is made here, untimed (in a gateway its refresher makes it between
            # requests): awaited inside the timing, it counted the whole event loop's work meanwhile (the fleet's
            # client, both routers), and the decision column read 11-17 ms at 256-1,000 engines.
            await router.engines(model)
            t = time.perf_counter()
            decision, records = await router.route(RouteRequest(
                request.tenant, model, request.num_prompt_tokens, chains[request.index],
                request.text[:APPROX_PREFIX_CHARS] if policy == "approx_prefix" else "", request.session_id))
            decision_us = (time.perf_counter() - t) * 1e6
            engine_id = decision.ranked[0]
            # As the gateway does (gateway/request/call.py): the prompt tokens to prefill there, declared to the
            # replica and counted against it here until the first token.
            prefill_tokens = decision.tokens_to_prefill(request.num_prompt_tokens)
            body = orjson.dumps({"request_id": f"fleet-{request.index}-{time.monotonic_ns()}",
                                 "prompt_token_ids": request.token_ids(), "max_tokens": request.max_tokens,
                                 "ignore_eos": True, "prefill_tokens": prefill_tokens})
            with router.in_flight(engine_id, prefill_tokens) as flight:
                async with session.post(f"{records[engine_id].url}/generate", data=body,
                                        headers=signed_headers("POST", "/generate", body)) as resp:
                    if resp.status != 200:
                        errors.note(f"/generate {resp.status}: {(await resp.text())[:120]}")
                        return _failed(request, scheduled, start, time_scale)
                    stream = await read_generate_stream(resp.content, flight.prefilled)
            if stream.error is not None:
                errors.note(f"/generate error line: {stream.error}")
                return _failed(request, scheduled, start, time_scale)
        except Exception as exc:  # counted and reported with the run; one request's failure never stops it
            errors.note(f"{type(exc).__name__}: {exc}")
            return _failed(request, scheduled, start, time_scale)
        now = time.perf_counter()
        return Outcome(((stream.first_token_s or now) - scheduled) / time_scale, (now - start) / time_scale,
                       int(stream.stats.get("num_cached_tokens", 0)), request.num_prompt_tokens,
                       int(stream.stats.get("num_output_tokens", 0)), True, engine_id, decision_us)

    try:
        outcomes = await replay(requests, one, time_scale)
        extra: dict[str, Any] = {"errors": errors.top()}
        # What each worker learned of the engines' prefill time (routing/prefill_clock.py), in simulated ms.
        extra["prefill_fits"] = [None if (fit := r.prefill_clock.fit) is None else
                                 {"intercept_ms": fit.intercept_s * 1e3 / time_scale,
                                  "ms_per_1000_tokens": fit.s_per_token * 1e6 / time_scale} for r in routers]
        feeds = [r.local_feed for r in routers if r.local_feed is not None]
        if feeds:
            lags = [lag for f in feeds if (lag := f.lag_p99_s()) is not None]
            extra["event_lag_p99_ms"] = max(lags) * 1e3 if lags else None
            # One worker's index (each holds the same blocks).
            extra["index_bytes"] = index_bytes(feeds[0].index)
            extra["index_blocks"] = feeds[0].index.num_blocks
        return RunResult(outcomes, extra)
    finally:
        await session.close()
        for router in routers:
            await router.close()
        held.close()
        await redis.aclose()


async def run_openai(base_url: str, requests: Sequence[FleetRequest], model: str, time_scale: float) -> RunResult:
    """The workload through an OpenAI-compatible router: streamed ``/v1/completions`` with the prompt as
    text (the sim tokenizes it to the same bytes the Tessera path sends as token ids)."""
    session = _session()
    errors = Errors()

    async def one(request: FleetRequest, scheduled: float, start: float) -> Outcome:
        body = {"model": model, "prompt": request.text, "max_tokens": request.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}}
        first: float | None = None
        usage: dict[str, Any] = {}
        try:
            async with session.post(f"{base_url}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    errors.note(f"{resp.status}: {(await resp.text())[:120]}")
                    return _failed(request, scheduled, start, time_scale)
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = orjson.loads(line[5:])
                    if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                        first = time.perf_counter()
                    if chunk.get("usage"):
                        usage = chunk["usage"]
        except Exception as exc:  # counted and reported with the run; one request's failure never stops it
            errors.note(f"{type(exc).__name__}: {exc}")
            return _failed(request, scheduled, start, time_scale)
        now = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        return Outcome(((first or now) - scheduled) / time_scale, (now - start) / time_scale,
                       int(details.get("cached_tokens") or 0), request.num_prompt_tokens,
                       int(usage.get("completion_tokens") or 0))

    try:
        outcomes = await replay(requests, one, time_scale)
        return RunResult(outcomes, {"errors": errors.top()})
    finally:
        await session.close()
