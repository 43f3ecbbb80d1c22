"""Shared benchmark plumbing: processes, percentiles, result files and tables."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
# The benchmarks run as scripts (``python bench/bench_x.py``): the repository root makes ``tests.support``
# importable, whose machine helpers (ports, CPU sets) tests and benchmarks share.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tessera.data_plane_auth import ensure_key_file  # noqa: E402
from tessera.gateway.launch import GatewayLaunch  # noqa: E402
from tests.support.machine import free_port, pin_this_process, pinned, split_cores  # noqa: E402

# The data-plane key: every replica, gateway and controller a benchmark starts inherits it, and the benchmarks'
# own calls straight to a replica sign with it (ENGINE_AUTH for httpx, signed_headers otherwise).
os.environ.setdefault("TESSERA_DATA_PLANE_KEY_FILE", str(ensure_key_file(REPO / ".tessera" / "data-plane.key")))
from tests.support.data_plane import ENGINE_AUTH, signed_headers  # noqa: E402, F401

RESULTS = REPO / "bench" / "results"
BIN = Path(sys.executable).parent


async def read_request_body(reader: asyncio.StreamReader) -> bytes:
    """The next HTTP/1.1 request on a keep-alive connection to one of the benches' fake servers: its body,
    by Content-Length (``asyncio.IncompleteReadError`` once the client closes)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for header in head.split(b"\r\n"):
        if header.lower().startswith(b"content-length:"):
            length = int(header.split(b":", 1)[1])
    return await reader.readexactly(length)


def first_on_pythonpath(directory: Path, pythonpath: str | None) -> str:
    """``pythonpath`` with ``directory`` first: how a bench's probe (a ``sitecustomize.py`` there) gets into the
    Python processes started with it, vLLM's spawned engine core included, where a patch made in the bench's own
    process never reaches."""
    return os.pathsep.join([str(directory), *filter(None, [pythonpath])])


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 99)) -> list[float]:
    if not values:
        return [float("nan")] * len(qs)
    return [float(np.percentile(np.asarray(values), q)) for q in qs]


def start_engine(
    config: dict[str, Any], env: dict[str, str], log: Path, timeout_s: float = 300, cpus: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    ready = log.with_suffix(".url")
    ready.unlink(missing_ok=True)
    # process_group, not a new session: see tests/support/gateways.py (autogroup starvation beside vLLM).
    # Bound to ``cpus``, vLLM's OpenMP threads must be told too (its auto binding would pick core 0 anyway).
    bind = {"VLLM_CPU_OMP_THREADS_BIND": cpus} if cpus else {}
    proc = subprocess.Popen(
        pinned([str(BIN / "tessera"), "engine", "serve", "--config", json.dumps(config), "--ready-file", str(ready)],
                cpus),
        env={**os.environ, **env, **bind}, stdout=log.open("wb"), stderr=subprocess.STDOUT, process_group=0,
    )
    deadline = time.monotonic() + timeout_s
    with stopped_if_start_fails(lambda: stop(proc)):
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"engine did not start; see {log}")
            time.sleep(0.5)
    return proc, ready.read_text()


def start_gateway(
    env: dict[str, str], log: Path, workers: int = 1, timeout_s: float = 60, cpus: str | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen(
        pinned(GatewayLaunch(port=port, workers=workers, metrics_dir=log.parent / f"gateway-{port}-metrics")
                .command(str(BIN / "python")), cpus),
        env={**os.environ, **env}, stdout=log.open("wb"), stderr=subprocess.STDOUT, process_group=0,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    with stopped_if_start_fails(lambda: stop(proc)):
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"gateway did not start; see {log}")


@contextmanager
def stopped_if_start_fails(stop_it: Callable[[], None]) -> Iterator[None]:
    """Around the wait for a process the bench just started: a wait that fails or is interrupted (Ctrl-C, SIGTERM
    by ``stop_on_sigterm``) stops it before the exception goes on, since no caller's ``finally`` holds it yet."""
    try:
        yield
    except BaseException:
        stop_it()
        raise


def stop_on_sigterm() -> None:
    """Has SIGTERM (a `kill`, a CI timeout) raise KeyboardInterrupt in the bench's main thread, as Ctrl-C does, so
    its `finally` blocks stop the gateways, engines and Redis it started; SIGTERM's default action ended the bench
    alone and left them running. Called first in a bench's ``main``."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


def bench_model(name: str, spec: Any = None) -> Path:
    """``.tessera/models/NAME``, a generated small model (``SmallModelSpec``; default: the default one),
    made on first use."""
    from tessera.engine.small_model import is_small_model_dir, make_small_model

    model_dir = (REPO / ".tessera" / "models" / name).resolve()
    if not is_small_model_dir(model_dir):
        print(f"generating {model_dir.relative_to(REPO)}", flush=True)
        make_small_model(model_dir, spec)
    return model_dir


@dataclass
class BenchSetup:
    model_dir: Path  # the default small model, generated when missing
    work: Path  # a fresh directory for logs and spans
    redis: Any  # tessera.redis_conn.EmbeddedRedis, started
    engine_cpus: str | None
    platform_cpus: str | None


def bench_setup(name: str, pinning: bool = True) -> BenchSetup:
    """The common start of the gateway benchmarks: the small model, a work directory, this process pinned to
    the platform's cores (the engine gets the first core, see split_cores), and an embedded Redis started
    from here, so it shares the platform's cores too."""
    from tessera.redis_conn import EmbeddedRedis

    model_dir = bench_model("tessera-small")
    engine_cpus, platform_cpus = split_cores() if pinning else (None, None)
    pin_this_process(platform_cpus)
    return BenchSetup(model_dir, Path(tempfile.mkdtemp(prefix=f"bench-{name}-")), EmbeddedRedis().start(),
                      engine_cpus, platform_cpus)


def issue_keys(redis_url: str, tenants: dict[str, Any]) -> dict[str, str]:
    """Creates each tenant (name -> TenantPolicy, or None for the defaults) and returns name -> a new key."""
    import asyncio

    from tessera.redis_conn import connect
    from tessera.tenancy.store import TenantStore

    async def create() -> dict[str, str]:
        client = connect(redis_url)
        store = TenantStore(client)
        keys = {}
        for name, policy in tenants.items():
            await store.create_tenant(name, policy)
            keys[name] = (await store.issue_key(name)).plaintext
        await client.aclose()
        return keys

    return asyncio.run(create())


def cpu_seconds(pid: int, with_children: bool = False) -> float:
    """CPU time of a process, all its threads, from the scheduler's nanosecond counters
    (/proc/PID/task/*/schedstat). psutil's cpu_times counts 10 ms ticks: too coarse for an idle
    background of a few milliseconds per second. ``with_children``: its live descendants' too (a gateway's
    supervisor and its workers)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
            if with_children:
                total += sum(round(cpu_seconds(int(child), True) * 1e9)
                             for child in (task / "children").read_text().split())
        except (OSError, ValueError, IndexError):
            continue  # a thread or child that ended meanwhile
    return total / 1e9


def median_difference_ci(base: Sequence[float], other: Sequence[float], rounds: int = 2000,
                         seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of median(other) - median(base): how far the noise of two samples of a few
    dozen requests each lets their difference move (each sample resampled on its own)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    a, b = np.asarray(base, dtype=float), np.asarray(other, dtype=float)
    diffs = (np.median(rng.choice(b, (rounds, len(b))), axis=1)
             - np.median(rng.choice(a, (rounds, len(a))), axis=1))
    low, high = np.percentile(diffs, [2.5, 97.5])
    return float(low), float(high)


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    def fmt(value: Any) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print(" | ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
