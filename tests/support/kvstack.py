"""A small real platform for the controller's tests and benchmark: engines (``tessera engine serve``), one
gateway process (uvicorn), and the controller (``tessera-kvcontrol``), each its own process, all writing
spans to one run directory. Nothing is faked: real vLLM (CPU build), real Redis, real HTTP.

Also a streaming client that measures TTFT and E2E the way a user sees them.

Each process is its own process group in the caller's session, never a session of its own: see
tests/support/gateways.py for how a lone autogroup was starved beside vLLM's busy threads.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

from tessera.gateway.launch import GatewayLaunch
from tests.support.data_plane import ENGINE_AUTH
from tests.support.machine import free_port, pinned

BIN = Path(sys.executable).parent
ADMIN_TOKEN = "kvcontrol-admin"

# The gateways' registry max age in this stack (TESSERA_REGISTRY_MAX_AGE_S), seconds.
REGISTRY_MAX_AGE_S = 0.5


def _stop(proc: subprocess.Popen[bytes] | None, timeout_s: float = 20) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class StackOptions:
    model_dir: Path
    redis_url: str
    run_dir: Path
    num_engines: int = 1
    # Tiny KV cache so a few long prompts evict and preempt: 64 blocks x 32 tokens.
    engine: dict[str, Any] = field(default_factory=lambda: {
        "num_gpu_blocks_override": 64, "block_size": 32, "max_model_len": 1536, "max_num_batched_tokens": 256,
    })
    routing_policy: str = "prefix_affinity"
    served_model_name: str = "kvc-small"
    env: dict[str, str] = field(default_factory=dict)
    # CPU sets (``taskset -c`` syntax) for the engines and for the gateway and controller; None: no pinning.
    # The benchmark pins them apart, so the engine's busy threads do not starve the gateway's event loop.
    engine_cpus: str | None = None
    platform_cpus: str | None = None


class KVStack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.engines: dict[str, subprocess.Popen[bytes]] = {}
        self.engine_urls: dict[str, str] = {}
        self.gateway: subprocess.Popen[bytes] | None = None
        self.controller: subprocess.Popen[bytes] | None = None
        self.gateway_url = ""
        self.metrics_url = ""
        self.options.run_dir.mkdir(parents=True, exist_ok=True)

    @property
    def model(self) -> str:
        return self.options.served_model_name

    def env(self, **extra: str) -> dict[str, str]:
        o = self.options
        return {**os.environ, "TESSERA_REDIS_URL": o.redis_url, "TESSERA_TRACE_EXPORTER": "jsonl",
                "TESSERA_TRACE_DIR": str(o.run_dir / "traces"), "TESSERA_ROUTING_POLICY": o.routing_policy,
                "TESSERA_ADMIN_TOKEN": ADMIN_TOKEN, "VLLM_CPU_KVCACHE_SPACE": "1",
                # NOTE: two engines under load oversubscribe this 2-core machine, and a process can stall past
                # the default 250 ms Redis timeout (the gateway then fails closed with 503); the fault tests of
                # that timeout live with the tenancy tests.
                "TESSERA_REDIS_TIMEOUT_S": "2.0",
                # A gateway's registry view is never older than this: tests wait this long for a flag to count.
                "TESSERA_REGISTRY_REFRESH_S": str(REGISTRY_MAX_AGE_S / 2),
                "TESSERA_REGISTRY_MAX_AGE_S": str(REGISTRY_MAX_AGE_S), **o.env, **extra}

    # ---- processes -------------------------------------------------------------------------------

    def start(self, timeout_s: float = 600) -> KVStack:
        o = self.options
        ready = {f"kv-{chr(ord('a') + i)}": o.run_dir / f"kv-{chr(ord('a') + i)}.url" for i in range(o.num_engines)}
        for engine_id, path in ready.items():
            self._launch_engine(engine_id, path)
        deadline = time.monotonic() + timeout_s
        relaunched: set[str] = set()
        for engine_id, path in ready.items():
            while not path.exists():
                if self.engines[engine_id].poll() is not None and engine_id not in relaunched:
                    # NOTE: once, with the engine's own words in the test report: a start-up failure that
                    # repeats still fails the run, and the log says why.
                    warnings.warn(f"engine {engine_id} exited while starting; relaunching it once. Its log:\n"
                                  f"{self._log_tail(engine_id)}", stacklevel=2)
                    relaunched.add(engine_id)
                    self._launch_engine(engine_id, path)
                if self.engines[engine_id].poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"engine {engine_id} did not start; the end of its log:\n"
                                       f"{self._log_tail(engine_id)}")
                time.sleep(0.5)
            self.engine_urls[engine_id] = path.read_text().strip()
        port = free_port()
        self.gateway = subprocess.Popen(
            pinned(GatewayLaunch(port=port, metrics_dir=o.run_dir / "gateway-metrics").command(str(BIN / "python")),
                    o.platform_cpus),
            env=self.env(), stdout=(o.run_dir / "gateway.log").open("wb"), stderr=subprocess.STDOUT,
            process_group=0)
        self.gateway_url = f"http://127.0.0.1:{port}"
        self._wait_http(f"{self.gateway_url}/health", self.gateway, deadline, "gateway")
        return self

    def _launch_engine(self, engine_id: str, ready_file: Path) -> None:
        o = self.options
        config = {"model": str(o.model_dir), "served_model_name": o.served_model_name, **o.engine}
        ready_file.unlink(missing_ok=True)
        self.engines[engine_id] = subprocess.Popen(
            pinned([str(BIN / "tessera"), "engine", "serve", "--config", json.dumps(config), "--engine-id",
                     engine_id, "--ready-file", str(ready_file)], o.engine_cpus),
            env=self.env(**({"VLLM_CPU_OMP_THREADS_BIND": o.engine_cpus} if o.engine_cpus else {})),
            stdout=(o.run_dir / f"{engine_id}.log").open("ab"), stderr=subprocess.STDOUT, process_group=0)

    def _log_tail(self, engine_id: str, lines: int = 40) -> str:
        text = (self.options.run_dir / f"{engine_id}.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def start_controller(self, policy: dict[str, Any] | None = None, observe_only: bool = False,
                         poll_interval_s: float = 0.1, timeout_s: float = 120) -> None:
        self.stop_controller()
        port = free_port()
        env = self.env(TESSERA_KVCONTROL_METRICS_PORT=str(port), TESSERA_KVCONTROL_POLL_INTERVAL_S=str(poll_interval_s),
                       TESSERA_KVCONTROL_DISCOVERY_INTERVAL_S="0.5", TESSERA_KVCONTROL_TENANT_REFRESH_S="0.5",
                       TESSERA_KVCONTROL_OBSERVE_ONLY="1" if observe_only else "0", TESSERA_KVCONTROL_LOG_LEVEL="DEBUG",
                       TESSERA_KVCONTROL_POLICY=json.dumps(policy or {}))
        log = (self.options.run_dir / "kvcontrol.log").open("ab")
        self.controller = subprocess.Popen(pinned([str(BIN / "tessera-kvcontrol")], self.options.platform_cpus),
                                           env=env, stdout=log,
                                           stderr=subprocess.STDOUT, process_group=0)
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        deadline = time.monotonic() + timeout_s
        self._wait_http(self.metrics_url, self.controller, deadline, "kvcontrol")
        while self.metric("tessera_kvcontrol_engines") < len(self.engines):
            if time.monotonic() > deadline:
                raise RuntimeError("the controller did not pick up every engine")
            time.sleep(0.2)
        time.sleep(0.5)  # the loops' ZMQ subscriptions connect asynchronously

    def stop_controller(self) -> None:
        _stop(self.controller)
        self.controller = None

    def stop(self) -> None:
        self.stop_controller()
        _stop(self.gateway)
        for proc in self.engines.values():
            _stop(proc, timeout_s=40)

    @staticmethod
    def _wait_http(url: str, proc: subprocess.Popen[bytes], deadline: float, name: str) -> None:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}")
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{name} did not answer {url} in time")

    # ---- observation -----------------------------------------------------------------------------

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a metric's samples (matching the labels) on the controller's /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for family in text_string_to_metric_families(httpx.get(self.metrics_url, timeout=5).text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def engine_stats(self, engine_id: str) -> dict[str, Any]:
        return dict(httpx.get(f"{self.engine_urls[engine_id]}/stats", timeout=5, auth=ENGINE_AUTH).json())

    def wait_idle(self, timeout_s: float = 120) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(not httpx.get(f"{u}/requests", timeout=5, auth=ENGINE_AUTH).json()
                   for u in self.engine_urls.values()):
                return
            time.sleep(0.1)
        raise TimeoutError("engines still busy")

    async def create_tenant(self, name: str, **policy: Any) -> str:
        from tessera.redis_conn import connect
        from tessera.tenancy.policy import TenantPolicy
        from tessera.tenancy.store import TenantStore

        redis = connect(self.options.redis_url, timeout_s=5)
        try:
            store = TenantStore(redis)
            if await store.get_tenant(name) is None:
                await store.create_tenant(name, TenantPolicy(**policy))
            else:
                await store.set_policy(name, TenantPolicy(**policy))
            return (await store.issue_key(name)).plaintext
        finally:
            await redis.aclose()


@dataclass
class Completion:
    status: int
    ttft_s: float | None
    e2e_s: float
    text: str
    usage: dict[str, Any]
    engine: str
    request_id: str
    error: str = ""
    retry_after: str | None = None
    sent_at: float = 0.0


async def complete(client: httpx.AsyncClient, base_url: str, key: str, model: str, prompt: Sequence[int],
                   max_tokens: int, headers: dict[str, str] | None = None,
                   on_first_token: Callable[[], Awaitable[Any]] | None = None, **extra: Any) -> Completion:
    """One streamed completion; TTFT is the first SSE data line, E2E the end of the stream.
    ``on_first_token`` runs once the first token arrived (the request is then running on its engine)."""
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}
    start = time.monotonic()
    ttft = None
    texts: list[str] = []
    usage: dict[str, Any] = {}
    error = ""
    async with client.stream("POST", f"{base_url}/v1/completions", json=body,
                             headers={"authorization": f"Bearer {key}", **(headers or {})}) as resp:
        if resp.status_code != 200:
            raw = await resp.aread()
            return Completion(resp.status_code, None, time.monotonic() - start, "", {}, "",
                              resp.headers.get("x-request-id", ""), raw.decode(errors="replace"),
                              resp.headers.get("retry-after"), start)
        async for line in _sse_lines(resp):
            # Buffered lines do not suspend the iteration: yield, or a long stream starves every other task.
            await asyncio.sleep(0)
            if not line.startswith(b"data: "):
                continue
            if ttft is None:
                ttft = time.monotonic() - start
                if on_first_token is not None:
                    await on_first_token()
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = orjson.loads(data)
            if "error" in chunk:
                error = str(chunk["error"])
                continue
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                texts.append(choice.get("text") or "")
    return Completion(200, ttft, time.monotonic() - start, "".join(texts), usage,
                      resp.headers.get("x-tessera-engine", ""), resp.headers.get("x-request-id", ""), error,
                      sent_at=start)


async def _sse_lines(resp: httpx.Response) -> AsyncIterator[bytes]:
    """Lines split on b"\\n" only: JSON text may hold U+2028 and friends, which ``aiter_lines`` splits on."""
    buffer = b""
    async for chunk in resp.aiter_bytes():
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r")
    if buffer:
        yield buffer


def new_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=200))


async def gather_limited(coros: Sequence[Any], limit: int) -> list[Any]:
    semaphore = asyncio.Semaphore(limit)

    async def run(coro: Any) -> Any:
        async with semaphore:
            return await coro

    return list(await asyncio.gather(*(run(c) for c in coros)))
