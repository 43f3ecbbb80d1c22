"""The whole platform on one machine: embedded Redis, a local Ray with the engine deployment, the gateway.

Used by ``make run`` (``tessera up``) and by the end-to-end tests' fixture, so what the tests exercise is
exactly what a developer runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from tessera.cpu_info import read_cpu_flags
from tessera.data_plane_auth import ensure_key_file
from tessera.engine.config import EngineConfig, default_small_model_dir
from tessera.engine.ports import free_port
from tessera.engine.small_model import is_small_model_dir, make_small_model
from tessera.gateway.launch import GatewayLaunch
from tessera.local.engine_failure import engines_failed
from tessera.local.ray_settings import quiet_ray_env, ray_init_kwargs
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera.telemetry.gc_heap import FREEZE_ENV
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import TenantStore

ENGINE_APP = "tessera-engines"
# vLLM's queue busy-wait for engines on cores of their own (`engine_placement_defaults`): longer than a decode
# step of the small model on one core (3-6 ms), far shorter than vLLM's 1 s. Measured with
# `bench_stack.py --tessera-up-args`: docs/performance.md section 7.
PINNED_SHM_BUSY_LOOP_S = 0.01
# The split leaves the engine cores of its own only from this many CPUs up. With fewer (2), one engine core
# would halve the prefill's compute (an AVX2-only 2-core VM: TTFT p50 50 -> 36 ms with both cores, E2E p50 94
# -> 77 ms; docs/performance.md section 7), so the engine computes on the platform's core too, and its OpenMP
# threads wait there as ``SHARED_CORE_OMP_WAIT`` says.
MIN_CPUS_FOR_OWN_ENGINE_CORES = 3
# ... except where the CPU computes on 512-bit vectors: there the prefill on one thread is short (an avx512 VM
# without AMX: TTFT p50 21.3-21.6 ms on one thread against vLLM alone's 19.7-22.2 on two), and a second
# thread's barrier wake-ups on the shared core cost every decode step more than its compute saves (sequential
# E2E p50 88.6-89.6 ms on one thread against 97.7-104.1 on two, CPU per request 173-175 against 186-194 ms;
# docs/performance.md section 7). So on a shared core such a CPU's engine runs one OpenMP thread where vLLM runs
# the model in a worker process of its own (``cpuModelInEngineCore: false``). With the model in the engine core
# (the default) the second thread pays again: sequential E2E p50 61.6 / 78.6 ms on two threads against 84.4 /
# 81.9 on one, CPU per request 71 / 91 against 95 / 95 ms (same VM, docs/performance.md section 7).
WIDE_VECTOR_CPU_FLAGS = frozenset({"avx512f", "amx_tile"})
# On the shared core an OpenMP thread that finds no work spins for GOMP_SPINCOUNT iterations (libgomp's estimate:
# 100,000 a millisecond), then sleeps until woken. Not passive (no spin): a thread that sleeps after every parallel
# region must be woken for the next (a futex wake, on a VM an idle vCPU brought back through the hypervisor),
# hundreds of times a decode step: 16 tokens after a 0.1-0.25 s idle gap decoded in 59-69 ms passive, 29-42 ms with
# a ~1 ms spin (an avx512 VM). How long: ~3 ms, libgomp's own default (what `vllm serve` runs with), written out so
# that no inherited setting shortens it; not ACTIVE's forever, which would hold the platform's core whenever the
# engine idles. A ~1 ms spin (the default until 2026-12-06) ran level with it where the VM was quiet and lost to it
# in every pair where the hypervisor took 11-19 % of the vCPUs' time (steal), whose wake of a sleeping thread waits
# for the hypervisor to run its vCPU again (docs/performance.md section 7, "Under steal").
SHARED_CORE_OMP_WAIT = {"GOMP_SPINCOUNT": "300000"}
# Either of these in the environment replaces SHARED_CORE_OMP_WAIT whole: it is the operator's choice of wait.
OMP_WAIT_SETTINGS = frozenset({"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"})
# How long the banner key waits for its fsync: Valkey's everysec fsync plus its 2 s postponed write, with room.
_KEY_FSYNC_WAIT_MS = 5000


class PlatformStartError(RuntimeError):
    """The local platform could not start; the message is the root cause, in a line or two."""


@dataclass
class LocalPlatformOptions:
    state_dir: Path = Path(".tessera")
    model_dir: Path | None = None
    num_engines: int = 1
    gateway_port: int = 8000
    gateway_workers: int = 2
    gateway_host: str = "127.0.0.1"
    redis_url: str | None = None
    routing_policy: str = "prefix_affinity"
    admin_token: str | None = None
    engine_overrides: dict[str, Any] = field(default_factory=dict)
    trace_dir: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # The KV-eviction controller, as the chart runs it: its policy is tessera-kvcontrol's PolicyConfig (JSON,
    # camelCase; None: its defaults, as the chart's), its spans go to the run's trace directory.
    kvcontrol: bool = True
    kvcontrol_policy: dict[str, Any] | None = None
    # Pin Ray and the engine replicas to all cores but the last, and Redis, the gateway and the controller to
    # the last one (needs 2 cores or more; docs/performance.md has what it measured). Off here, so a caller
    # that embeds the platform (the end-to-end tests) keeps its own placement; `tessera up` turns it on.
    cpu_split: bool = False


class LocalPlatform:
    def __init__(self, options: LocalPlatformOptions) -> None:
        self.options = options
        self.redis: EmbeddedRedis | None = None
        self.redis_url = options.redis_url or ""
        self.gateway: subprocess.Popen[bytes] | None = None
        self.kvcontrol: subprocess.Popen[bytes] | None = None
        self.kvcontrol_metrics_url = ""
        self.gateway_metrics_url = ""
        self.engine_config: EngineConfig | None = None
        self._ray_started = False
        self._redis_lock: IO[str] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.options.gateway_host}:{self.options.gateway_port}"

    @property
    def model(self) -> str:
        assert self.engine_config is not None, "start() first"
        return self.engine_config.served_model_name

    @property
    def run_dir(self) -> Path:
        return self.options.state_dir / "run"

    @property
    def redis_data_dir(self) -> Path:
        """The embedded Redis's append-only file, kept between runs (``rm -r`` it to start empty)."""
        return self.options.state_dir / "redis"

    @property
    def trace_dir(self) -> Path:
        return (self.options.trace_dir or self.options.state_dir / "traces").resolve()

    def start(self, timeout_s: float = 600.0) -> LocalPlatform:
        deadline = time.monotonic() + timeout_s
        opts = self.options
        engine_cpus, platform_cpus = split_cpus() if opts.cpu_split else (None, None)
        has_gpu = _has_gpu()
        model_dir = opts.model_dir or default_small_model_dir(opts.state_dir)
        if opts.model_dir is None and not is_small_model_dir(model_dir):
            print(f"[tessera] generating the small model in {model_dir}", flush=True)
            make_small_model(model_dir)
        if not (model_dir / "config.json").exists():
            raise FileNotFoundError(f"{model_dir} has no config.json: give a Hugging Face model directory")
        self.engine_config = EngineConfig.model_validate(
            {"model": str(model_dir.resolve()), "served_model_name": opts.engine_overrides.get(
                "served_model_name", "tessera-small" if opts.model_dir is None else model_dir.name),
             **engine_placement_defaults(engine_cpus is not None and not has_gpu, opts.engine_overrides),
             **opts.engine_overrides})
        self.engine_config.validate_for_cpu() if not has_gpu else None

        own_cpus = os.sched_getaffinity(0)
        _pin(platform_cpus)  # what this process starts from here on inherits its CPUs
        self.start_redis()
        env = self._env()
        for name, value in engine_thread_env(engine_cpus, platform_cpus, own_cpus, opts.num_engines,
                                             os.environ, read_cpu_flags(),
                                             not self.engine_config.runs_model_in_engine_core).items():
            env.setdefault(name, value)
        os.environ.update(env)

        print(f"[tessera] starting Ray Serve with {opts.num_engines} engine replica(s)", flush=True)
        _pin(engine_cpus)
        self._start_ray(env)
        _pin(platform_cpus)
        self._start_gateway(env)
        self._wait_ready(deadline)
        if opts.kvcontrol:
            self._start_kvcontrol(env, deadline)
        os.sched_setaffinity(0, own_cpus)  # this process itself was only the parent
        return self

    def start_redis(self) -> None:
        """The embedded Redis (unless ``redis_url`` names one), keeping its data in ``redis_data_dir``: the
        tenants, keys, budgets and usage of one `tessera up` are there in the next."""
        if not self.redis_url:
            self._lock_redis_data_dir()
            self.redis = EmbeddedRedis(data_dir=self.redis_data_dir).start()
            self.redis_url = self.redis.url
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "redis_url").write_text(self.redis_url)

    def _lock_redis_data_dir(self) -> None:
        """Two servers appending to one AOF would corrupt it: a second `tessera up` on the same state
        directory stops here. The lock is the kernel's (flock), so a killed run leaves none behind."""
        self.redis_data_dir.mkdir(parents=True, exist_ok=True)
        lock = (self.redis_data_dir / "tessera-up.lock").open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise PlatformStartError(f"another `tessera up` is running on {self.redis_data_dir}: stop it, or "
                                     "give this one its own --state-dir") from None
        self._redis_lock = lock

    def _env(self) -> dict[str, str]:
        opts = self.options
        env = {
            "TESSERA_REDIS_URL": self.redis_url,
            "TESSERA_ROUTING_POLICY": opts.routing_policy,
            "TESSERA_TRACE_DIR": str(self.trace_dir),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            # NOTE: vLLM's CPU build pins each engine's threads to the same cores by default; several local
            # replicas would then share one core. Let the OS schedule them.
            "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
            # The key every call to an engine replica is signed with: the one given, else one generated once
            # per state directory and reused by every later run (docs/security.md).
            "TESSERA_DATA_PLANE_KEY_FILE": os.environ.get("TESSERA_DATA_PLANE_KEY_FILE")
            or str(ensure_key_file(opts.state_dir / "data-plane.key").resolve()),
            **opts.extra_env,
        }
        # Passed on where set, so an A/B measurement reaches the engine replica too (tessera/telemetry/gc_heap.py).
        if FREEZE_ENV in os.environ:
            env.setdefault(FREEZE_ENV, os.environ[FREEZE_ENV])
        if opts.admin_token:
            env["TESSERA_ADMIN_TOKEN"] = opts.admin_token
        return env

    def _start_ray(self, env: dict[str, str]) -> None:
        import ray
        from ray import serve

        from tessera.engine.deployment import build_app

        assert self.engine_config is not None
        # Read by Ray's own processes as they start (see ray_settings.py).
        os.environ.update(quiet_ray_env())
        ray.init(**ray_init_kwargs(max(2, os.cpu_count() or 2), env))
        self._ray_started = True
        serve.start(proxy_location="Disabled")
        app = build_app({"engine": self.engine_config.model_dump(by_alias=True), "replicas": self.options.num_engines})
        # Not waiting for the application to run (``serve.run`` waits, even with blocking=False): the gateway
        # starts while the engines load, and ``_wait_ready`` reads Serve's status meanwhile, so a config the
        # platform refuses stops `tessera up` at the first replica's failure instead of after Serve's retries
        # (engine_failure.py).
        try:
            serve.run_many([serve.RunTarget(app, name=ENGINE_APP, route_prefix=None)],
                           wait_for_applications_running=False)
        except RuntimeError as exc:
            self._raise_if_engines_failed()
            raise PlatformStartError(f"the engine replicas could not start: {exc}") from exc

    def _start_gateway(self, env: dict[str, str]) -> None:
        opts = self.options
        metrics_port = free_port()
        # The gateway's /metrics is on a port apart from the API (it names tenants; gateway/metrics.py).
        self.gateway_metrics_url = f"http://{opts.gateway_host}:{metrics_port}/metrics"
        cmd = GatewayLaunch(host=opts.gateway_host, port=opts.gateway_port, workers=opts.gateway_workers,
                            metrics_dir=self.run_dir / "gateway-metrics", metrics_port=metrics_port).command()
        # Its own process group (Ctrl-C in the terminal does not reach it; shutdown stops it in order), but in
        # this session, where Ray's engine processes are too: with the kernel's autogroup scheduling each
        # session is a scheduling group, and a gateway alone in one was seen starved for seconds beside the
        # engine's busy threads on a 2-core machine (see tests/support/gateways.py).
        self.gateway = subprocess.Popen(cmd, env={**os.environ, **env}, process_group=0)

    def engines(self) -> list[EngineRecord]:
        """The live engine replicas as they registered: address, and what each runs (KV dtype, capacity,
        speculative method, fallbacks)."""
        async def read() -> list[EngineRecord]:
            redis = connect(self.redis_url, timeout_s=5)
            try:
                return await EngineRegistry(redis).live_engines()
            finally:
                await redis.aclose()

        return asyncio.run(read())

    def _start_kvcontrol(self, env: dict[str, str], deadline: float) -> None:
        """``tessera-kvcontrol`` for every engine in the registry, started after them (it finds engines that
        come later by itself); ready once its metrics endpoint answers."""
        port = free_port()
        kv_env = {**os.environ, **env, "TESSERA_KVCONTROL_METRICS_PORT": str(port)}
        if self.options.kvcontrol_policy is not None:
            kv_env["TESSERA_KVCONTROL_POLICY"] = json.dumps(self.options.kvcontrol_policy)
        log = (self.run_dir / "kvcontrol.log").open("ab")
        # In this session, as the gateway (see _start_gateway).
        self.kvcontrol = subprocess.Popen([str(Path(sys.executable).parent / "tessera-kvcontrol")], env=kv_env,
                                          stdout=log, stderr=subprocess.STDOUT, process_group=0)
        self.kvcontrol_metrics_url = f"http://127.0.0.1:{port}/metrics"
        while time.monotonic() < deadline:
            if self.kvcontrol.poll() is not None:
                tail = (self.run_dir / "kvcontrol.log").read_text(errors="replace").strip().splitlines()[-5:]
                raise PlatformStartError("the KV-eviction controller exited with code "
                                         f"{self.kvcontrol.returncode}: " + " | ".join(tail))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.kvcontrol_metrics_url, timeout=2).status_code == 200:
                    return
            time.sleep(0.5)
        raise PlatformStartError("the KV-eviction controller did not answer on its metrics port in time")

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.gateway is not None and self.gateway.poll() is not None:
                raise PlatformStartError(f"the gateway exited with code {self.gateway.returncode}")
            self._raise_if_engines_failed()
            if len(self.engines()) >= self.options.num_engines:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                        return
            time.sleep(1.0)
        raise TimeoutError("the platform did not become ready in time")

    def _raise_if_engines_failed(self) -> None:
        """Ray Serve gave up on the engine replicas, or one failed as no retry can mend (engine_failure.py): say
        why in a line, not Ray's traceback."""
        from ray import serve

        app = serve.status().applications.get(ENGINE_APP)
        if app is None:
            return
        details = "\n".join([app.message, *(d.message for d in app.deployments.values())])
        cause = engines_failed(app.status, details)  # a str enum: equal to its value
        if cause is not None:
            raise PlatformStartError(f"the engine replicas could not start: {cause}")

    async def create_tenant(self, name: str, policy: TenantPolicy | None = None) -> str:
        redis = connect(self.redis_url, timeout_s=5)
        try:
            store = TenantStore(redis)
            if await store.get_tenant(name) is None:
                await store.create_tenant(name, policy)
            elif policy is not None:
                await store.set_policy(name, policy)
            key = (await store.issue_key(name)).plaintext
            if self.redis is not None:
                # The key is printed once and never again: wait until the embedded server's append-only file
                # holds it on disk. Valkey acknowledges a write before its everysec fsync and, while an fsync
                # is still running (a busy disk), postpones even the write for up to 2 s, so a SIGKILL right
                # after the banner could otherwise lose the key it printed.
                await redis.waitaof(1, 0, _KEY_FSYNC_WAIT_MS)
            return key
        finally:
            await redis.aclose()

    def stop(self) -> None:
        # The controller first: on SIGTERM it releases every demotion and pressure flag it holds in Redis.
        for process in (self.kvcontrol, self.gateway):
            if process is not None and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
        if self._ray_started:
            import ray
            from ray import serve

            with contextlib.suppress(Exception):
                serve.shutdown()
            ray.shutdown()
            self._ray_started = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None
        if self._redis_lock is not None:
            self._redis_lock.close()  # releases the flock
            self._redis_lock = None
        with contextlib.suppress(FileNotFoundError):
            (self.run_dir / "redis_url").unlink()


def engine_placement_defaults(engine_pinned: bool, overrides: dict[str, Any]) -> dict[str, Any]:
    """EngineConfig defaults that follow from where the engine runs (the caller's overrides win).

    ``engine_pinned``: the engine computes on the CPU, on cores the split gave it (2 cores or more; on 2 it
    shares the platform's, where this busy-wait was measured too, docs/performance.md section 7). Then
    vLLM's queue readers may busy-wait briefly: a reader that yields (``sched_yield``) on a core whose other
    task is the model's own thread gives way to it, and a window longer than a decode step keeps a running
    request's hand-overs free of socket wake-ups, while the readers sleep ``PINNED_SHM_BUSY_LOOP_S`` after a
    request ends instead of vLLM's second. Unpinned, the platform's default (0 on CPU) stands: there the spin
    takes the gateway's and Redis's core; with a GPU, so does vLLM's own second (its steps may outlast 10 ms)."""
    if not engine_pinned or "shm_busy_loop_s" in overrides or "shmBusyLoopS" in overrides:
        return {}
    return {"shm_busy_loop_s": PINNED_SHM_BUSY_LOOP_S}


def split_cpus() -> tuple[set[int] | None, set[int] | None]:
    """(engine CPUs, platform CPUs): all this process may use but the last, and the last; with fewer than
    ``MIN_CPUS_FOR_OWN_ENGINE_CORES``, all of them and the last (the engine shares the platform's core);
    (None, None) with fewer than 2."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None, None
    engine_cpus = cpus if len(cpus) < MIN_CPUS_FOR_OWN_ENGINE_CORES else cpus[:-1]
    return set(engine_cpus), {cpus[-1]}


def engine_thread_env(engine_cpus: set[int] | None, platform_cpus: set[int] | None, own_cpus: set[int],
                      num_engines: int, environ: Mapping[str, str],
                      flags: frozenset[str] = frozenset(), model_in_worker_process: bool = False) -> dict[str, str]:
    """The engines' OpenMP settings (a value already in ``environ`` wins).

    Ray sets OMP_NUM_THREADS to an actor's whole CPUs (1 for the engine replica) unless it is set; vLLM's CPU
    build then computes on one thread where `vllm serve` uses every core it may run on. So: one thread per
    engine core, several replicas sharing the cores between them. Where the engine's cores include the
    platform's (``split_cpus`` on 2 CPUs), its threads spin about a millisecond, then sleep
    (``SHARED_CORE_OMP_WAIT``; a wait setting in ``environ`` replaces both); and on a CPU with
    ``WIDE_VECTOR_CPU_FLAGS`` (``flags``: the CPU's, ``tessera.cpu_info``) whose model runs in a vLLM worker
    process (``model_in_worker_process``) there is one thread, the shared core left to the platform's
    processes."""
    env: dict[str, str] = {}
    shares = engine_cpus is not None and platform_cpus is not None and bool(engine_cpus & platform_cpus)
    if "OMP_NUM_THREADS" not in environ:
        engine_cores = len(engine_cpus) if engine_cpus else len(own_cpus)
        threads = max(1, engine_cores // max(1, num_engines))
        if shares and model_in_worker_process and flags & WIDE_VECTOR_CPU_FLAGS:
            threads = 1
        env["OMP_NUM_THREADS"] = str(threads)
    if shares and not OMP_WAIT_SETTINGS & environ.keys():
        env |= SHARED_CORE_OMP_WAIT
    return env


def _pin(cpus: set[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
