"""What one engine replica costs in CPU per request, and which knob buys what (docs/performance.md).

Setup: one ``EngineHost`` in this process (vLLM CPU build, the small model), with an embedded Redis so the
host's registry heartbeat and prefix-index feed run as in production. Workload: sequential streamed
requests of ``--prompt-tokens`` random tokens (unique, so every request stores new KV blocks and publishes
KV events) and ``--max-tokens`` output tokens. Measured: CPU seconds (user + system) of this process and
all its children (vLLM's engine core and worker) and of Redis, per request, over the measured requests
only; and the wall time per request.

    .venv/bin/python bench/bench_engine_host.py                       # platform defaults
    .venv/bin/python bench/bench_engine_host.py --no-kv-events        # KV events and the index feed off
    .venv/bin/python bench/bench_engine_host.py --no-spec             # speculation off
    .venv/bin/python bench/bench_engine_host.py --shm-busy-loop-s 1   # vLLM's own shm busy-wait (1 s)
    .venv/bin/python bench/bench_engine_host.py --idle-s 5            # + CPU of the idle replica
    .venv/bin/python bench/bench_engine_host.py --ab-shm 5 --requests 6 --ab-values 1,0.005,0
        # 1 s vs 5 ms vs 0 s busy-wait, interleaved
        # in blocks of --requests within ONE engine (a switch every vLLM process reads, see BusyWaitSwitch):
        # both arms see the same machine load, which matters on a shared machine
    .venv/bin/python bench/bench_engine_host.py --stack [--cpu-split]
        # the whole local platform (`tessera up`): the same requests through the gateway, CPU of everything
    .venv/bin/python bench/bench_engine_host.py --ray-idle 20 [--ray-defaults]
        # no engine: CPU share of Ray started as `tessera up` starts it (Serve controller included), idle,
        # with local/ray_settings.py's quiet settings or Ray's defaults
"""

from __future__ import annotations

import argparse
import json
import os
import random
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import ENGINE_AUTH, REPO, first_on_pythonpath, stop_on_sigterm

MODEL_DIR = REPO / ".tessera" / "models" / "tessera-small"
VOCAB = int(json.loads((MODEL_DIR / "config.json").read_text())["vocab_size"])


def is_redis(proc: psutil.Process) -> bool:
    try:
        return any(name in proc.name() for name in ("valkey", "redis"))
    except psutil.NoSuchProcess:
        return False


def tree_cpu_s(process: psutil.Process, redis: bool = False) -> float:
    """CPU seconds (user + system) of a process and its live descendants, Redis apart (``redis``: Redis only)."""
    total = 0.0
    for proc in [process, *process.children(recursive=True)]:
        if is_redis(proc) != redis:
            continue
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def one_request(client: httpx.Client, url: str, prompt_tokens: int, max_tokens: int, rng: random.Random) -> int:
    body = {"request_id": f"b-{time.monotonic_ns()}", "prompt_token_ids": [rng.randrange(10, VOCAB - 10)
                                                                           for _ in range(prompt_tokens)],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.0}
    lines = 0
    with client.stream("POST", f"{url}/generate", json=body, auth=ENGINE_AUTH) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            lines += bool(line)
    return lines


def ray_idle(seconds: float, ray_defaults: bool, label: str, out: str) -> None:
    import os

    from tessera.local.ray_settings import quiet_ray_env, ray_init_kwargs

    env = {} if ray_defaults else quiet_ray_env()
    os.environ.update(env)
    import ray
    from ray import serve

    ray.init(**ray_init_kwargs(max(2, os.cpu_count() or 2), env))
    serve.start(proxy_location="Disabled")
    try:
        time.sleep(10.0)  # start-up settles
        me = psutil.Process()
        processes = [me, *me.children(recursive=True)]

        def per_process() -> dict[str, float]:
            out: dict[str, float] = {}
            for proc in processes:
                try:
                    times, name = proc.cpu_times(), " ".join(proc.cmdline()[:2])[-60:]
                except psutil.NoSuchProcess:
                    continue
                out[f"{proc.pid} {name}"] = times.user + times.system
            return out

        before = per_process()
        time.sleep(seconds)
        after = per_process()
        shares = {name: round((after[name] - before.get(name, 0.0)) / seconds, 3) for name in after}
        share = sum(shares.values())
    finally:
        serve.shutdown()
        ray.shutdown()
    result = {"label": label, "ray_defaults": ray_defaults, "ray_idle_cpu_share": round(share, 3),
              "num_processes": len(processes), "quiet_env": env,
              "by_process": dict(sorted(shares.items(), key=lambda kv: -kv[1])[:6])}
    print("RESULT " + json.dumps(result), flush=True)
    if out:
        with open(out, "a") as sink:
            sink.write(json.dumps(result) + "\n")


# Put on PYTHONPATH as sitecustomize.py, it runs first in every Python process started from here, vLLM's
# spawned engine core and worker included, and makes their shm readers busy-wait for the float in CAP_FILE,
# read at each wait (vLLM's CPU build always spawns, so a patch in this process would not reach them).
SWITCH_SOURCE = """
import mmap, os, struct
_path = os.environ.get("TESSERA_BENCH_BUSY_CAP_FILE")
if _path:
    from vllm.distributed.device_communicators import shm_broadcast
    _fd = os.open(_path, os.O_RDONLY)
    _cap = mmap.mmap(_fd, 8, prot=mmap.PROT_READ)
    _original = shm_broadcast.SpinCondition.wait
    def _wait(self, timeout_ms=None):
        self.busy_loop_s = struct.unpack_from("d", _cap)[0]
        _original(self, timeout_ms)
    shm_broadcast.SpinCondition.wait = _wait
"""


class BusyWaitSwitch:
    """The busy-wait of every vLLM process started after ``__init__``, switchable at run time."""

    def __init__(self, workdir: Path) -> None:
        import mmap

        (workdir / "sitecustomize.py").write_text(SWITCH_SOURCE)
        self._path = workdir / "busy-cap"
        self._path.write_bytes(struct.pack("d", 1.0))
        self._file = open(self._path, "r+b")  # noqa: SIM115 - mapped for the switch's lifetime
        self._map = mmap.mmap(self._file.fileno(), 8)
        os.environ["TESSERA_BENCH_BUSY_CAP_FILE"] = str(self._path)
        os.environ["PYTHONPATH"] = first_on_pythonpath(workdir, os.environ.get("PYTHONPATH"))

    def set(self, busy_loop_s: float) -> None:
        struct.pack_into("d", self._map, 0, busy_loop_s)


def run_block(client: httpx.Client, url: str, args: argparse.Namespace, rng: random.Random,
              me: psutil.Process) -> tuple[float, float]:
    """(CPU ms, wall ms) per request over ``args.requests`` sequential requests."""
    cpu0, wall0 = tree_cpu_s(me), time.monotonic()
    for _ in range(args.requests):
        one_request(client, url, args.prompt_tokens, args.max_tokens, rng)
    return (1000 * (tree_cpu_s(me) - cpu0) / args.requests, 1000 * (time.monotonic() - wall0) / args.requests)


def ab_shm(args: argparse.Namespace) -> None:
    from tessera.engine.config import EngineConfig
    from tessera.engine.host import EngineHost
    from tessera.redis_conn import EmbeddedRedis

    switch = BusyWaitSwitch(Path(tempfile.mkdtemp(prefix="tessera-bench-")))
    overrides: dict[str, Any] = {"model": str(MODEL_DIR), "shm_busy_loop_s": 1.0}
    if args.no_spec:
        overrides["speculative"] = None
    redis = EmbeddedRedis().start()
    host = EngineHost(EngineConfig.model_validate(overrides), redis.url).start()
    me = psutil.Process()
    rng = random.Random(0)
    arms: dict[float, list[tuple[float, float]]] = {float(v): [] for v in args.ab_values.split(",")}
    try:
        with httpx.Client(timeout=120) as client:
            for _ in range(args.warmup):
                one_request(client, host.url, args.prompt_tokens, args.max_tokens, rng)
            for _ in range(args.ab_shm):
                for value in arms:
                    switch.set(value)
                    one_request(client, host.url, args.prompt_tokens, args.max_tokens, rng)  # switch settles
                    arms[value].append(run_block(client, host.url, args, rng, me))
    finally:
        host.stop()
        redis.stop()
    result = {"label": args.label, "mode": "ab-shm", "blocks": args.ab_shm, "requests_per_block": args.requests,
              "spec": not args.no_spec, "load_avg_1m": round(os.getloadavg()[0], 2)}
    for value, blocks in arms.items():
        cpu = sorted(b[0] for b in blocks)
        wall = sorted(b[1] for b in blocks)
        result[f"busy_{value:g}s"] = {"cpu_ms_per_request_median": round(cpu[len(cpu) // 2], 1),
                                      "cpu_ms_blocks": [round(c, 1) for c in (b[0] for b in blocks)],
                                      "wall_ms_per_request_median": round(wall[len(wall) // 2], 1)}
    print("RESULT " + json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "a") as sink:
            sink.write(json.dumps(result) + "\n")


def stack(args: argparse.Namespace) -> None:
    """The same sequential requests through `tessera up`'s gateway (OpenAI completions, streamed)."""
    import asyncio
    import socket

    from tessera.local.platform import LocalPlatform, LocalPlatformOptions

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    state = Path(tempfile.mkdtemp(prefix="tessera-bench-stack-"))
    platform = LocalPlatform(LocalPlatformOptions(state_dir=state, model_dir=MODEL_DIR, gateway_port=port,
                                                  cpu_split=args.cpu_split))
    me = psutil.Process()
    rng = random.Random(0)

    def one(client: httpx.Client, key: str) -> None:
        prompt = " ".join(f"w{rng.randrange(100000)}" for _ in range(args.prompt_tokens // 2))
        with client.stream("POST", f"{platform.base_url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                           json={"model": platform.model, "prompt": prompt, "max_tokens": args.max_tokens,
                                 "stream": True, "temperature": 0.0}) as response:
            response.raise_for_status()
            for _ in response.iter_lines():
                pass

    try:
        platform.start()
        key = asyncio.run(platform.create_tenant("bench"))
        with httpx.Client(timeout=120) as client:
            for _ in range(args.warmup):
                one(client, key)
            time.sleep(1.5)
            cpu0, wall0 = tree_cpu_s(me) + tree_cpu_s(me, redis=True), time.monotonic()
            walls = []
            for _ in range(args.requests):
                start = time.monotonic()
                one(client, key)
                walls.append(time.monotonic() - start)
            cpu1, wall1 = tree_cpu_s(me) + tree_cpu_s(me, redis=True), time.monotonic()
    finally:
        platform.stop()
    result = {"label": args.label, "mode": "stack", "cpu_split": args.cpu_split, "requests": args.requests,
              "cpu_ms_per_request": round(1000 * (cpu1 - cpu0) / args.requests, 1),
              "wall_ms_per_request": round(1000 * (wall1 - wall0) / args.requests, 1),
              "wall_ms_p50": round(1000 * sorted(walls)[len(walls) // 2], 1),
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    print("RESULT " + json.dumps(result), flush=True)
    if args.out:
        with open(args.out, "a") as sink:
            sink.write(json.dumps(result) + "\n")


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=350)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--no-kv-events", action="store_true")
    parser.add_argument("--no-spec", action="store_true")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--shm-busy-loop-s", type=float, default=None, help="default: the EngineConfig default")
    parser.add_argument("--idle-s", type=float, default=0.0, help="also measure this long idle after the run")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", default="", help="append the result line (JSON) to this file")
    parser.add_argument("--ab-shm", type=int, default=0, help="interleaved blocks of each --ab-values busy-wait")
    parser.add_argument("--ab-values", default="1,0", help="busy-waits (seconds) compared by --ab-shm")
    parser.add_argument("--stack", action="store_true", help="through the whole local platform instead")
    parser.add_argument("--cpu-split", action="store_true", help="with --stack: LocalPlatformOptions.cpu_split")
    parser.add_argument("--ray-idle", type=float, default=0.0, help="measure an idle Ray for this long instead")
    parser.add_argument("--ray-defaults", action="store_true", help="with --ray-idle: Ray's own defaults")
    args = parser.parse_args()
    if args.ray_idle:
        ray_idle(args.ray_idle, args.ray_defaults, args.label, args.out)
        return
    if args.ab_shm:
        ab_shm(args)
        return
    if args.stack:
        stack(args)
        return

    from tessera.engine.config import EngineConfig
    from tessera.engine.host import EngineHost
    from tessera.engine.vllm_engine import shm_busy_loop_s
    from tessera.redis_conn import EmbeddedRedis

    overrides: dict[str, Any] = {"model": str(MODEL_DIR)}
    if args.no_kv_events:
        overrides["kv_events"] = {"enabled": False}
    if args.no_spec:
        overrides["speculative"] = None
    if args.shm_busy_loop_s is not None:
        overrides["shm_busy_loop_s"] = args.shm_busy_loop_s
    redis = None if args.no_redis else EmbeddedRedis().start()
    host = EngineHost(EngineConfig.model_validate(overrides), redis.url if redis else None).start()
    me = psutil.Process()
    rng = random.Random(0)
    try:
        with httpx.Client(timeout=60) as client:
            for _ in range(args.warmup):
                one_request(client, host.url, args.prompt_tokens, args.max_tokens, rng)
            time.sleep(1.5)  # let vLLM's readers fall idle, so the run starts from the same state each time
            cpu0, redis0, wall0 = tree_cpu_s(me), tree_cpu_s(me, redis=True), time.monotonic()
            walls = []
            for _ in range(args.requests):
                start = time.monotonic()
                one_request(client, host.url, args.prompt_tokens, args.max_tokens, rng)
                walls.append(time.monotonic() - start)
            cpu1, redis1, wall1 = tree_cpu_s(me), tree_cpu_s(me, redis=True), time.monotonic()
            # What the replica burns in the second after a request, with nothing to do: vLLM's shm readers
            # busy-waiting (see engine/shm_wait.py).
            time.sleep(1.0)
            tail_cpu_s = tree_cpu_s(me) - cpu1
            idle_cpu_per_s = 0.0
            if args.idle_s:
                time.sleep(1.5)
                idle0 = tree_cpu_s(me)
                time.sleep(args.idle_s)
                idle_cpu_per_s = (tree_cpu_s(me) - idle0) / args.idle_s
        result = {
            "label": args.label, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
            "max_tokens": args.max_tokens, "kv_events": not args.no_kv_events, "spec": not args.no_spec,
            "shm_busy_loop_s": shm_busy_loop_s(host.config),
            "host_cpu_ms_per_request": round(1000 * (cpu1 - cpu0) / args.requests, 1),
            "redis_cpu_ms_per_request": round(1000 * (redis1 - redis0) / args.requests, 1),
            "wall_ms_per_request": round(1000 * (wall1 - wall0) / args.requests, 1),
            "wall_ms_p50": round(1000 * sorted(walls)[len(walls) // 2], 1),
            "cpu_s_in_the_second_after": round(tail_cpu_s, 3),
            "idle_cpu_share": round(idle_cpu_per_s, 3),
            "load_avg_1m": round(os.getloadavg()[0], 2),
        }
        print("RESULT " + json.dumps(result), flush=True)
        if args.out:
            with open(args.out, "a") as out:
                out.write(json.dumps(result) + "\n")
    finally:
        host.stop()
        if redis is not None:
            redis.stop()


if __name__ == "__main__":
    main()
