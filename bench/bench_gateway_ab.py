"""make bench-gateway-ab REVS="7111dda HEAD work": the gateway of several git revisions side by side, against one
engine replica, for the cost a change adds per streamed chunk and per request.

``make bench-gateway`` run once per revision compares more than the gateway: each run starts its own engine
(whose pace sets how cold the gateway goes between chunks, and so what a chunk costs), at another moment of
a shared machine. Here every revision's gateway runs at once (``PYTHONPATH`` at a ``git worktree`` of that
revision; ``work`` is the working tree), all behind the same Redis and the same engine replica of the
working tree, and the measurement rotates between them round by round, so the engine's pace, the machine's
load and its drift fall on all of them alike. Each revision gets what ``bench_gateway.chunk_cost`` measures:
long and short streams in pairs, each short one padded to the long one's wall time, so the difference is
the CPU per chunk with neither the per-request cost nor the background in it; the short streams alone give
the CPU per request (background included, alike for all).

Options: ``--revs A,B,...`` (default ``HEAD,work``; a revision named twice, e.g. ``HEAD,HEAD,work``, runs
two gateways of it, whose difference is the noise floor; a directory stands for the ``platform/src`` under it,
e.g. a copy with an experiment in it), ``--model paced|small`` (default paced: ~30 ms between
chunks, where a chunk costs most), ``--rounds`` (default 3), ``--pairs`` per round (default 4), ``--long``
tokens (default 256).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _support import (
    REPO,
    bench_model,
    bench_setup,
    cpu_seconds,
    issue_keys,
    print_table,
    start_engine,
    start_gateway,
    stop,
    stop_on_sigterm,
    write_results,
)
from bench_gateway import CHUNK_COST_SHORT, PACED_MODEL, one_gateway

WORKING_TREE = "work"


@dataclass
class Revision:
    name: str
    source: Path  # the platform/src this revision's gateway imports
    url: str = ""
    pid: int = 0
    per_chunk_ms: list[float] = field(default_factory=list)  # one per round
    per_short_request_ms: list[float] = field(default_factory=list)
    chunk_interval_ms: list[float] = field(default_factory=list)


def option(name: str, default: str) -> str:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def checkout(rev: str, into: Path) -> Path:
    """A detached worktree of ``rev`` (its platform sources are all the gateway needs from it)."""
    if rev == WORKING_TREE:
        return REPO / "platform" / "src"
    if Path(rev).is_dir():  # a copy of the sources with an experiment in it
        return Path(rev) / "platform" / "src"
    tree = into / rev.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(tree), rev], check=True,
                   capture_output=True)
    return tree / "platform" / "src"


async def one_round(rev: Revision, key: str, model: str, pairs: int, long: int) -> None:
    cpu_long = cpu_short = wall_long = 0.0
    chunks_long = chunks_short = 0
    async with aiohttp.ClientSession() as session:
        await one_gateway(session, rev.url, key, CHUNK_COST_SHORT, model)  # warm this gateway's connection
        for _ in range(pairs):
            cpu0, wall0 = cpu_seconds(rev.pid), time.perf_counter()
            chunks_long += (await one_gateway(session, rev.url, key, long, model))["chunks"]
            cpu1, wall1 = cpu_seconds(rev.pid), time.perf_counter()
            chunks_short += (await one_gateway(session, rev.url, key, CHUNK_COST_SHORT, model))["chunks"]
            await asyncio.sleep(max(0.0, wall1 + (wall1 - wall0) - time.perf_counter()))
            cpu_long += cpu1 - cpu0
            cpu_short += cpu_seconds(rev.pid) - cpu1
            wall_long += wall1 - wall0
    rev.per_chunk_ms.append((cpu_long - cpu_short) / (chunks_long - chunks_short) * 1e3)
    rev.per_short_request_ms.append(cpu_short / pairs * 1e3)
    rev.chunk_interval_ms.append(wall_long / max(chunks_long, 1) * 1e3)


def main() -> None:
    stop_on_sigterm()
    names = option("--revs", f"HEAD,{WORKING_TREE}").split(",")
    paced = option("--model", "paced") == "paced"
    rounds, pairs, long = int(option("--rounds", "3")), int(option("--pairs", "4")), int(option("--long", "256"))
    setup = bench_setup("gateway-ab")
    trees = Path(tempfile.mkdtemp(prefix="bench-gateway-ab-trees-"))
    # A revision named twice runs two gateways of it: the spread between them is the noise floor (A/A).
    sources = {name: checkout(name, trees) for name in dict.fromkeys(names)}
    revisions = [Revision(Path(name).name + ("'" * names[:i].count(name)), sources[name])
                 for i, name in enumerate(names)]
    model_dir = bench_model("tessera-paced", PACED_MODEL) if paced else setup.model_dir
    served = "tessera-paced" if paced else "tessera-small"
    env = {"TESSERA_REDIS_URL": setup.redis.url, "TESSERA_TRACE_DIR": str(setup.work / "traces"),
           "TESSERA_ROUTING_POLICY": "prefix_affinity", "VLLM_CPU_KVCACHE_SPACE": "1"}
    engine, _ = start_engine({"model": str(model_dir.resolve()), "servedModelName": served}, env,
                             setup.work / "engine.log", cpus=setup.engine_cpus)
    gateways = []
    try:
        for rev in revisions:
            proc, rev.url = start_gateway({**env, "PYTHONPATH": str(rev.source)},
                                          setup.work / f"gateway-{rev.name}.log", cpus=setup.platform_cpus)
            rev.pid = proc.pid
            gateways.append(proc)
        key = issue_keys(setup.redis.url, {"bench": None})["bench"]
        time.sleep(3)  # the engine's registration and each gateway's catalog refresh
        for r in range(rounds):
            for i in range(len(revisions)):
                rev = revisions[(r + i) % len(revisions)]  # each round starts with the next revision
                asyncio.run(one_round(rev, key, served, pairs, long))
                print(f"  round {r + 1} {rev.name}: {rev.per_chunk_ms[-1]:.3f} ms per chunk", flush=True)
    finally:
        for proc in gateways:
            stop(proc)
        stop(engine)
        setup.redis.stop()
        for name in sources:
            if name != WORKING_TREE and not Path(name).is_dir():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force",
                                str(trees / name.replace("/", "_"))], capture_output=True)
        shutil.rmtree(trees, ignore_errors=True)

    print(f"\nGateway CPU per streamed chunk and per {CHUNK_COST_SHORT}-token request, {served}, {rounds} rounds "
          f"of {pairs} {long}-token streams per revision (median of rounds; min-max)")
    rows = []
    for rev in revisions:
        rows.append([rev.name, statistics.median(rev.chunk_interval_ms), statistics.median(rev.per_chunk_ms),
                     f"{min(rev.per_chunk_ms):.3f}-{max(rev.per_chunk_ms):.3f}",
                     statistics.median(rev.per_short_request_ms)])
    print_table(["revision", "ms between chunks", "CPU ms per chunk", "min-max", "CPU ms per short request"], rows)
    path = write_results("gateway-ab", {"model": served, "rounds": rounds, "pairs": pairs, "long": long,
                                        "cpu_flags": cpu_flags(),
                                        "revisions": [rev.__dict__ | {"source": str(rev.source)}
                                                      for rev in revisions]})
    print(f"results: {path}")


def cpu_flags() -> list[str]:
    flags = next((line.split(":", 1)[1].split() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), [])
    return sorted(f for f in flags if f.startswith(("avx512", "amx")))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
