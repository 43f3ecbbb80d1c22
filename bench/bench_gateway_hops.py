"""make bench-gateway-hops: where a streamed request's TTFT goes, hop by hop, through the gateway and direct.

One engine replica (pinned to the first core) and one gateway (with this client and Redis on the others),
as in bench_gateway. Requests go one at a time, alternating between the paths, 100 ms apart (the latency
of a lightly loaded platform, where every process wakes from idle). Client timestamps are joined with the
spans the gateway and the engine write (JSONL, wall clock of this one machine) by order: one request is in
flight at a time. The table says which part of the gateway's added TTFT is HTTP ingress, the gateway's own
work (auth, tokenization, admission and the prefix lookup in one Redis round trip, routing), the hop to the
engine, and the relay back.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import (
    bench_setup,
    issue_keys,
    median_difference_ci,
    print_table,
    signed_headers,
    start_engine,
    start_gateway,
    stop,
    stop_on_sigterm,
    write_results,
)

from tessera.gateway.models import load_served_model
from tessera.registry import ModelInfo
from tessera.telemetry.spanfile import SpanRecord, load_spans

PROMPT = "Tell me about the KV cache and speculative decoding in one paragraph."
REQUESTS = 150
GAP_S = 0.1
# The gateway's span processor exports every 5 s: wait that long for the last spans to reach the file.
EXPORT_WAIT_S = 7.0

Stamps = tuple[int, int]  # client send, client first event (time.time_ns)


async def through_gateway(session: aiohttp.ClientSession, url: str, key: str) -> Stamps:
    body = {"model": "tessera-small", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8,
            "temperature": 0.0, "stream": True}
    sent, first = time.time_ns(), 0
    async with session.post(f"{url}/v1/chat/completions", data=orjson.dumps(body),
                            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {") and not first:
                first = time.time_ns()
    return sent, first


async def direct(session: aiohttp.ClientSession, url: str, ids: list[int]) -> Stamps:
    body = {"request_id": f"hops-{time.monotonic_ns()}", "prompt_token_ids": ids, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True}
    sent, first = time.time_ns(), 0
    data = orjson.dumps(body)
    async with session.post(f"{url}/generate", data=data, headers=signed_headers("POST", "/generate", data)) as resp:
        async for line in resp.content:
            if not first and "d" in orjson.loads(line):
                first = time.time_ns()
    return sent, first


async def drive(engine_url: str, gateway_url: str, key: str, ids: list[int]) -> tuple[int, list[Stamps], list[Stamps]]:
    via, straight = [], []
    async with aiohttp.ClientSession() as session:
        for _ in range(5):  # warm both paths (tokenizer, connections, scripts)
            await through_gateway(session, gateway_url, key)
            await direct(session, engine_url, ids)
        await asyncio.sleep(EXPORT_WAIT_S)  # the warm-up's spans are exported before the mark
        mark = time.time_ns()
        for _ in range(REQUESTS):
            await asyncio.sleep(GAP_S)
            via.append(await through_gateway(session, gateway_url, key))
            await asyncio.sleep(GAP_S)
            straight.append(await direct(session, engine_url, ids))
    return mark, via, straight


def event(span: SpanRecord, name: str) -> int:
    found = span.event(name)
    if found is None:
        raise RuntimeError(f"span {span.name} of trace {span.trace_id} has no {name} event")
    return found.ts_ns


def hops(trace_dir: Path, mark: int, via: list[Stamps], straight: list[Stamps]) -> dict[str, dict[str, list[int]]]:
    spans = [s for s in load_spans([trace_dir]) if s.start_ns >= mark]
    requests = sorted((s for s in spans if s.name == "gateway.request"), key=lambda s: s.start_ns)
    traced = {s.trace_id for s in requests}
    calls = {s.trace_id: s for s in spans if s.name == "engine.call"}
    engine = {s.trace_id: s for s in spans if s.name == "engine.generate"}
    direct_spans = sorted((s for s in spans if s.name == "engine.generate" and s.trace_id not in traced),
                          key=lambda s: s.start_ns)
    if len(requests) != len(via) or len(direct_spans) != len(straight):
        raise RuntimeError(f"spans do not match the requests: {len(requests)}/{len(via)} gateway, "
                           f"{len(direct_spans)}/{len(straight)} direct")
    g: dict[str, list[int]] = {}
    for (sent, first), req in zip(via, requests, strict=True):
        call, gen = calls[req.trace_id], engine[req.trace_id]
        for name, value in (("client -> gateway (HTTP ingress)", req.start_ns - sent),
                            ("gateway work before the engine call", call.start_ns - req.start_ns),
                            ("gateway -> engine (HTTP hop)", gen.start_ns - call.start_ns),
                            ("engine: start -> first token", event(gen, "first_token") - gen.start_ns),
                            ("engine first token -> gateway", event(req, "first_token") - event(gen, "first_token")),
                            ("gateway -> client (relay)", first - event(req, "first_token")),
                            ("TTFT", first - sent)):
            g.setdefault(name, []).append(value)
    d: dict[str, list[int]] = {}
    for (sent, first), gen in zip(straight, direct_spans, strict=True):
        for name, value in (("client -> engine (HTTP ingress)", gen.start_ns - sent),
                            ("engine: start -> first token", event(gen, "first_token") - gen.start_ns),
                            ("engine first token -> client", first - event(gen, "first_token")),
                            ("TTFT", first - sent)):
            d.setdefault(name, []).append(value)
    return {"gateway": g, "direct": d}


def main() -> None:
    stop_on_sigterm()
    setup = bench_setup("hops")
    model_dir, work, redis = setup.model_dir, setup.work, setup.redis
    engine_cpus, platform_cpus = setup.engine_cpus, setup.platform_cpus
    env = {"TESSERA_REDIS_URL": redis.url, "TESSERA_TRACE_DIR": str(work / "traces"), "VLLM_CPU_KVCACHE_SPACE": "1"}
    engine, engine_url = start_engine({"model": str(model_dir.resolve()), "servedModelName": "tessera-small"},
                                      env, work / "engine.log", cpus=engine_cpus)
    gateway, gateway_url = start_gateway(env, work / "gateway.log", cpus=platform_cpus)
    try:
        key = issue_keys(redis.url, {"hops": None})["hops"]
        ids = load_served_model(ModelInfo("tessera-small", str(model_dir.resolve()), 2048, 32)).encode_chat(
            [{"role": "user", "content": PROMPT}])
        time.sleep(2)  # the engine's first heartbeat
        mark, via, straight = asyncio.run(drive(engine_url, gateway_url, key, ids))
        time.sleep(EXPORT_WAIT_S)
    finally:
        stop(gateway)
        stop(engine)
        redis.stop()
    table = hops(work / "traces", mark, via, straight)
    rows, payload = [], {}
    for path, parts in table.items():
        for name, values in parts.items():
            p50 = statistics.median(values) / 1e6
            rows.append([path, name, len(values), p50])
            payload[f"{path}: {name}"] = p50
    added = payload["gateway: TTFT"] - payload["direct: TTFT"]
    low, high = median_difference_ci(table["direct"]["TTFT"], table["gateway"]["TTFT"])
    print(f"\nTTFT hop by hop, one request at a time, {GAP_S * 1e3:.0f} ms apart (p50, ms)")
    print_table(["path", "hop", "n", "p50 ms"], rows)
    print(f"\ngateway - direct TTFT p50: {added:.3f} ms "
          f"(95% bootstrap interval {low / 1e6:.3f} to {high / 1e6:.3f} ms)")
    result = {"p50_ms": payload, "added_ttft_p50_ms": added, "ci95_ms": [low / 1e6, high / 1e6]}
    print(f"results: {write_results('gateway_hops', result)}")


if __name__ == "__main__":
    main()
