"""The gateway's own CPU: per streamed request and idle, the figures of issue #19's gateway goals
(≤ 3 ms per 16-token streamed chat, tokenization and the Redis round trips included; idle < 2 ms/s).
Run: ``make bench-gateway-cpu`` (about 40 s a run); writes bench/results/gateway_cpu.json.

A gateway worker started as the chart starts it (``tessera gateway``, via ``_support.start_gateway``), an
embedded Redis, and a fake engine in this process that answers ``/generate`` with ``TOKENS`` delta lines, 2 ms
apart, one write each, the last one with the closing line, as a decoding engine replica sends them (no vLLM:
only the gateway's CPU is under test). The client, the fake engine and Redis run outside the gateway process;
the gateway's CPU is read from its threads' scheduler counters (``_support.cpu_seconds``, nanoseconds).

Per run:
- ``per_request_ms``: gateway CPU over ``--requests`` sequential streamed chats, divided by their number
  (the background refreshers' share during those requests included);
- ``idle_after_ms_per_s``: CPU per second in the 8 s right after the traffic, while the caches' refreshers
  still run (they stop ``REFRESHER_IDLE_S`` after the last request);
- ``idle_late_ms_per_s``: CPU per second 13 s after the traffic, the refreshers stopped.

``--revs A,B,...`` runs the gateways of several git revisions side by side (``work``: the working tree; a
directory: the ``platform/src`` under it; a revision named twice: the noise floor), behind the same Redis and
fake engine, each measured in turn (every run starts with the next one) and idle over the same seconds:
a change's effect on the figures above without the machine's drift between two runs of the bench in it.
For example ``python bench/bench_gateway_cpu.py --revs 06f6e29,work``.

``--prompt-tokens N`` sends a different N-token prompt per request (bench-stack's are ~350) instead of one
short question, so the tokenizer's share is in the figure. ``--turns N`` makes the requests multi-turn chats of
N turns (each the history so far and a new question), where the gateway tokenizes only the new messages.

The fake engine stores each prompt's full blocks in the shared prefix index before its first delta, one batch,
as a replica's KV-event feeder does after a prefill, so the gateway's local index follows the event stream as
it does in a deployment (one stream read per request); ``--no-kv-events`` leaves the stream quiet. A short
question fills no block and stores nothing either way.

Beside them, the floor (``relay_floor.py``): a bare uvloop relay's CPU per line on this machine, times the
events of a request.

``--tokens N`` streams N tokens a request instead of 16: a run at 1 beside one at 16 parts a request's fixed CPU
from its CPU per streamed chunk (the goal is set at 16 only). ``--phases`` has the last revision's gateway count
its main thread's CPU clock by pipeline phase and socket callback (``gateway_phases/sitecustomize.py``, loaded
first on its ``PYTHONPATH``) and prints it per request: a profiler's share of each phase is inflated by its
per-call cost, these are the clock's. Its ``background`` rows are the work between requests (each cache
refresher's reads, the server's tick, the settler's probe, the index feed's own stream reads), per request
too; an awaiting row counts whatever the loop ran meanwhile, so read them at a pace (``--pause-ms``), where
little else runs.

``--workers N`` starts each gateway with N workers, as ``tessera up`` does with 2 (the figures are then the
supervisor's and the workers' CPU together), and ``--pause-ms MS`` has the client wait after each request (250:
bench-stack's 4 req/s pace), so the per-request figure carries the background between requests: bench-stack's
gateway column, side by side.

``SPY=path`` records a py-spy profile (raw format) of the gateway (the last revision named) during its
requests; ``SPY_NATIVE=1`` with it adds the native frames (uvloop, the interpreter, the kernel calls' wrappers).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import os
import shutil
import signal
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
from _support import (
    BIN,
    REPO,
    bench_model,
    cpu_seconds,
    first_on_pythonpath,
    print_table,
    read_request_body,
    start_gateway,
    stop,
    stop_on_sigterm,
    write_results,
)
from bench_gateway_ab import WORKING_TREE, checkout
from relay_floor import relay_floor_us

from tessera.engine.protocol import RequestStats, delta_line, done_line
from tessera.routing.hashing import block_hash_chain
from tessera.routing.prefix_index import PrefixIndex

TOKENS = 16
PHASES_PROBE = Path(__file__).resolve().parent / "gateway_phases"
LINE_GAP_S = 0.002
NUM_WARMUP = 30
NUM_REWARM = 5
IDLE_AFTER_S = 8.0
IDLE_LATE_START_S = 13.0
IDLE_LATE_S = 5.0
GOAL_PER_REQUEST_MS = 3.0
GOAL_IDLE_MS_PER_S = 2.0
SHORT_PROMPT = "Tell me about the KV cache and speculative decoding."


async def fake_engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, index: PrefixIndex | None,
                      engine_id: str, block_size: int) -> None:
    """``POST /generate``: ``max_tokens`` delta lines and the closing line, chunked, ``LINE_GAP_S`` apart.
    With ``index``, the prompt's full blocks are stored in the shared prefix index before the first delta, one
    batch, as the replica's KV-event feeder writes them after a prefill (engine/host.py): each gateway worker's
    local index then follows the stream as it does in a deployment."""
    try:
        while True:
            body = orjson.loads(await read_request_body(reader))
            if index is not None:
                hashes = block_hash_chain(body["prompt_token_ids"], block_size, body.get("cache_salt"))
                await index.apply(engine_id, [("store", h) for h in hashes])
            lines = [delta_line(0, f" w{i}", [100 + i]) + b"\n" for i in range(body["max_tokens"])]
            # As the replica writes them (engine/generation.py): the last delta with the closing line.
            lines[-1] += done_line({"0": "length"}, RequestStats()) + b"\n"
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\n"
                         b"transfer-encoding: chunked\r\n\r\n")
            for chunk in lines[:-1]:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await asyncio.sleep(LINE_GAP_S)
            # The last chunk and the body's end in one write, as uvicorn writes a response's last message (the
            # replica's server): written apart, LINE_GAP_S later, they cost the gateway a wake-up no replica causes.
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(lines[-1]), lines[-1]))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()
    except asyncio.CancelledError:
        writer.close()  # the run is over: asyncio.run cancels the handler of the idle keep-alive connection


async def read_phases(path: Path, num_requests: int) -> dict[str, dict[str, float]]:
    """What the phase probe wrote on SIGUSR2: per name, calls and microseconds of CPU per request."""
    for _ in range(50):
        await asyncio.sleep(0.1)
        if path.exists():  # written whole (renamed into place)
            counted = orjson.loads(path.read_bytes())
            path.unlink()
            return {name: {"calls": row["calls"] / num_requests, "us": row["ns"] / num_requests / 1e3}
                    for name, row in counted.items()}
    raise RuntimeError(f"the gateway's phase probe wrote nothing to {path}")


# The phase probe's rows in the order a request meets them, indented under what contains them.
PHASE_ROWS = (("request", "the request (Gateway.__call__), all below"), ("read", "  read the body"),
              ("authenticate", "  authenticate"), ("parse", "  parse"),
              ("prepare_prompt", "  prompt: template, tokens"), ("admit", "  admit: plan, hashes, Redis trip"),
              ("redis reads", "    Redis replies (also in settle)"), ("route", "  route"),
              ("call_engine", "  call the engine, stream to the client"),
              ("engine reads", "    engine chunks read and relayed"), ("settle", "  settle: metrics, spans, billing"),
              ("client reads", "client request bytes parsed (uvicorn)"),
              ("background: registry", "background: the registry's refresh"),
              ("background: key cache", "background: the key cache's refresh"),
              ("background: model catalog", "background: the model catalog's refresh"),
              ("background: index feed read", "background: the index feed's own reads"),
              ("background: settler probe", "background: the settler's probe"),
              ("background: tick", "background: the server's tick"), ("process", "the process, all threads"))


def phase_table(runs: list[dict[str, dict[str, Any]]], rev: str) -> list[list[str]]:
    """Rows (what, calls per request, us per request by run, median) of the runs' phase counts."""
    rows = []
    width = max(len(label) for _, label in PHASE_ROWS)
    for name, label in PHASE_ROWS:
        values = [r[rev]["phases_us"][name] for r in runs if name in r[rev].get("phases_us", {})]
        if values:
            us = [v["us"] for v in values]
            calls = "-" if name == "process" else f"{values[-1]['calls']:.1f}"
            rows.append([label.ljust(width), calls, *(f"{u:.0f}" for u in us),
                         f"{statistics.median(us):.0f}"])
    return rows


@dataclass
class Gateway:
    """One revision's gateway in a run (``--revs``)."""

    name: str
    source: Path | None  # the platform/src it imports (None: the installed one, the working tree)
    pid: int = 0
    url: str = ""


def chat_prompts(prompt_tokens: int, count: int) -> list[str]:
    """The user messages of a run: with ``prompt_tokens`` 0 one short question (every request alike), otherwise
    ``count`` different texts of that many of the model's tokens, as `make bench-stack` sends (no tokenizer
    cache can answer a repeat)."""
    if not prompt_tokens:
        return [SHORT_PROMPT]
    from stack.workload import PromptMaker

    maker = PromptMaker(bench_model("tessera-small"), prompt_tokens)
    return [maker.prompt(f"gateway-cpu-{i}") for i in range(count)]


def conversation(prompts: list[str], request: int, turns: int) -> list[dict[str, str]]:
    """Request ``request``'s messages: with ``turns`` 1 one user message; otherwise turn ``request % turns`` of
    a chat of that many turns (a system prompt, the earlier questions with their answers, the new question),
    each chat with questions of its own, so only its history repeats."""
    if turns <= 1:
        return [{"role": "user", "content": prompts[request % len(prompts)]}]
    chat, turn = divmod(request, turns)
    messages = [{"role": "system", "content": "You are a concise assistant. Answer in one short paragraph."}]
    for i in range(turn + 1):
        messages.append({"role": "user", "content": prompts[(chat * turns + i) % len(prompts)]})
        if i < turn:
            messages.append({"role": "assistant", "content": f"Answer {chat}.{i}: " + "it depends " * 8})
    return messages


async def one_run(num_requests: int, work: Path, revs: list[tuple[str, Path | None]], first: int,
                  prompts: list[str], kv_events: bool, turns: int = 1, tokens: int = TOKENS,
                  phases: bool = False, workers: int = 1, pause_s: float = 0.0) -> dict[str, Any]:
    """Every revision's gateway at once behind one Redis and one fake engine; measured one after the other,
    from ``revs[first]`` on (each run starts with the next, so drift falls on all alike), then idle together.
    ``phases``: the last revision's gateway also counts its CPU by phase (``phase_table``). ``workers``: each
    gateway's worker processes (more than one: its supervisor's and workers' CPU together). ``pause_s``: the
    client waits this long after each measured request."""
    from tessera.redis_conn import EmbeddedRedis, connect
    from tessera.registry import EngineRecord, EngineRegistry, ModelInfo, register_model
    from tessera.tenancy.store import TenantStore

    model_dir = bench_model("tessera-small")
    redis_server = EmbeddedRedis().start()
    redis = connect(redis_server.url)
    index = PrefixIndex(redis) if kv_events else None
    serve = functools.partial(fake_engine, index=index, engine_id="fake-0", block_size=32)
    engine = await asyncio.start_server(serve, "127.0.0.1", 0)
    engine_port = engine.sockets[0].getsockname()[1]
    await register_model(redis, ModelInfo("tessera-small", str(model_dir), 2048, 32))
    registry = EngineRegistry(redis)
    record = EngineRecord("fake-0", f"http://127.0.0.1:{engine_port}", "tessera-small", 32, 1000, 2048)

    async def heartbeat() -> None:
        while True:
            await registry.heartbeat(record)
            await asyncio.sleep(1.0)

    beating = asyncio.create_task(heartbeat())
    store = TenantStore(redis)
    await store.create_tenant("bench")
    key = (await store.issue_key("bench")).plaintext
    env = {"TESSERA_REDIS_URL": redis_server.url, "TESSERA_TRACE_DIR": str(work / "traces"),
           "TESSERA_ROUTING_POLICY": "prefix_affinity", "TESSERA_REDIS_TIMEOUT_S": "2"}
    gateways = [Gateway(name, source) for name, source in revs]
    procs: list[subprocess.Popen[bytes]] = []
    figures: dict[str, dict[str, Any]] = {}
    try:
        phases_out = work / "phases.json"
        for gw in gateways:
            gw_env = {**env, "PYTHONPATH": str(gw.source)} if gw.source is not None else env
            if phases and gw is gateways[-1]:
                gw_env = {**gw_env, "TESSERA_BENCH_PHASES_OUT": str(phases_out),
                          "PYTHONPATH": first_on_pythonpath(PHASES_PROBE, gw_env.get("PYTHONPATH"))}
            proc, gw.url = await asyncio.to_thread(start_gateway, gw_env, work / f"gateway-{len(procs)}.log", workers)
            procs.append(proc)
            gw.pid = proc.pid
        async with httpx.AsyncClient(timeout=10) as client:
            headers = {"authorization": f"Bearer {key}"}
            sent = itertools.count()

            async def one(url: str) -> int:
                chunks = 0
                body = {"model": "tessera-small", "stream": True, "max_tokens": tokens, "ignore_eos": True,
                        "messages": conversation(prompts, next(sent), turns)}
                async with client.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
                    assert r.status_code == 200, await r.aread()
                    async for line in r.aiter_lines():
                        chunks += line.startswith("data: {")
                return chunks

            for gw in gateways:
                for _ in range(NUM_WARMUP):
                    await one(gw.url)
            for i in range(len(gateways)):
                gw = gateways[(first + i) % len(gateways)]
                for _ in range(NUM_REWARM):  # the others' turns left this one idle a while
                    await one(gw.url)
                spy = None
                if os.environ.get("SPY") and gw is gateways[-1]:  # the last revision named (the working tree)
                    spy = subprocess.Popen([str(BIN / "py-spy"), "record", "-p", str(gw.pid), "-r", "500", "-f",
                                            "raw", "-o", os.environ["SPY"],
                                            *(["--native"] if os.environ.get("SPY_NATIVE") else ["--nonblocking"])],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    await asyncio.sleep(1.0)
                probed = phases and gw is gateways[-1]
                if probed:
                    os.kill(gw.pid, signal.SIGUSR1)  # the count starts now
                    await asyncio.sleep(0.2)
                c0 = cpu_seconds(gw.pid, with_children=True)
                for _ in range(num_requests):
                    num_chunks = await one(gw.url)
                    if pause_s:
                        await asyncio.sleep(pause_s)
                figures[gw.name] = {"chunks_per_request": num_chunks,
                                    "per_request_ms": (cpu_seconds(gw.pid, True) - c0) / num_requests * 1e3}
                if probed:
                    os.kill(gw.pid, signal.SIGUSR2)
                    figures[gw.name]["phases_us"] = await read_phases(phases_out, num_requests)
                if spy is not None:
                    spy.send_signal(2)
                    spy.wait(20)
            # All idle at once: each gateway's idle CPU over the same seconds.
            for measure, start_s, length_s in (("idle_after_ms_per_s", 0.0, IDLE_AFTER_S),
                                               ("idle_late_ms_per_s", IDLE_LATE_START_S - IDLE_AFTER_S, IDLE_LATE_S)):
                await asyncio.sleep(start_s)
                cpu0, w0 = {gw.name: cpu_seconds(gw.pid, True) for gw in gateways}, time.perf_counter()
                await asyncio.sleep(length_s)
                wall = time.perf_counter() - w0
                for gw in gateways:
                    figures[gw.name][measure] = (cpu_seconds(gw.pid, True) - cpu0[gw.name]) / wall * 1e3
    finally:
        for proc in procs:
            stop(proc)
        beating.cancel()
        engine.close()
        await redis.aclose()
        redis_server.stop()
    return figures


def main() -> None:
    stop_on_sigterm()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=150, help="Measured requests per run and revision.")
    parser.add_argument("--runs", type=int, default=3, help="Runs (each with fresh gateways and Redis).")
    parser.add_argument("--revs", default=WORKING_TREE,
                        help="Comma-separated git revisions (or directories holding platform/src) whose gateways "
                             f"run side by side; {WORKING_TREE!r} is the working tree (default: it alone).")
    parser.add_argument("--prompt-tokens", type=int, default=0,
                        help="Each request's prompt: 0 (default) one short question; N: a different N-token text "
                             "per request, as bench-stack sends (350 there).")
    parser.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                        help="The fake engine stores each prompt's blocks in the prefix index, as a replica's "
                             "KV-event feeder does, so the gateways' local indexes follow the stream (default: on).")
    parser.add_argument("--tokens", type=int, default=TOKENS,
                        help=f"Tokens each request streams (default {TOKENS}, the goal's): a run at 1 and one at "
                             f"{TOKENS} part a request's fixed CPU from its CPU per streamed chunk.")
    parser.add_argument("--phases", action="store_true",
                        help="Also count the last revision's CPU by phase and socket callback (its main thread's "
                             "CPU clock, gateway_phases/sitecustomize.py) and print it per request; the wrappers "
                             "add up to ~15 %% to that gateway's figures.")
    parser.add_argument("--turns", type=int, default=1,
                        help="1 (default): one message a request. N: multi-turn chats of N turns, each request "
                             "the whole history so far and a new question (the model's context is 2,048 tokens: "
                             "keep N x (prompt tokens + ~30) under it).")
    parser.add_argument("--workers", type=int, default=1,
                        help="Worker processes of each gateway (default 1, as the chart starts it; `tessera up` "
                             "starts 2): with more, the figures are its supervisor's and workers' together.")
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="The client waits this long after each measured request (250: bench-stack's 4 req/s "
                             "pace), so the per-request figure carries the gateway's background between requests.")
    args = parser.parse_args()
    if args.workers > 1 and (args.phases or os.environ.get("SPY")):
        parser.error("--phases and SPY read one worker's process: run them with --workers 1")
    import tempfile

    names = args.revs.split(",")
    trees = Path(tempfile.mkdtemp(prefix="bench-gateway-cpu-trees-"))
    sources = {name: None if name == WORKING_TREE else checkout(name, trees) for name in dict.fromkeys(names)}
    # A revision named twice runs two gateways of it: the spread between them is the noise floor (A/A).
    revs = [(Path(name).name + "'" * names[:i].count(name), sources[name]) for i, name in enumerate(names)]
    runs: list[dict[str, dict[str, Any]]] = []
    prompts = chat_prompts(args.prompt_tokens, len(revs) * (NUM_WARMUP + NUM_REWARM + args.requests))
    try:
        for i in range(args.runs):
            work = Path(tempfile.mkdtemp(prefix="bench-gateway-cpu-"))
            runs.append(asyncio.run(one_run(args.requests, work, revs, i % len(revs), prompts, args.kv_events,
                                            args.turns, args.tokens, args.phases, args.workers,
                                            args.pause_ms / 1e3)))
            print(f"run {i + 1}/{args.runs}: {runs[-1]}", flush=True)
    finally:
        for name, source in sources.items():
            if source is not None and not Path(name).is_dir():
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(source.parents[1])],
                               capture_output=True)
        shutil.rmtree(trees, ignore_errors=True)
    keys = ("per_request_ms", "idle_after_ms_per_s", "idle_late_ms_per_s")
    goals = {"per_request_ms": GOAL_PER_REQUEST_MS, "idle_after_ms_per_s": GOAL_IDLE_MS_PER_S,
             "idle_late_ms_per_s": GOAL_IDLE_MS_PER_S}
    medians = {rev: {k: statistics.median(r[rev][k] for r in runs) for k in keys} for rev, _ in revs}
    # The kernel's and uvloop's share, which no gateway code can remove: a bare relay's CPU per line times
    # the writes a request makes to its client.
    floor_us = relay_floor_us()
    chunks = runs[-1][revs[-1][0]]["chunks_per_request"]
    single = len(revs) == 1
    if args.tokens != TOKENS:
        goals["per_request_ms"] = float("nan")  # the goal is set at TOKENS tokens a request
    path = write_results("gateway_cpu", {"tokens": args.tokens, "line_gap_s": LINE_GAP_S, "requests": args.requests,
                                         "prompt_tokens": args.prompt_tokens or "short question",
                                         "turns": args.turns, "workers": args.workers,
                                         "pause_ms": args.pause_ms,
                                         "kv_events": args.kv_events,
                                         "revisions": [rev for rev, _ in revs],
                                         "runs": [r[revs[0][0]] for r in runs] if single else runs,
                                         "median": medians[revs[0][0]] if single else medians, "goals": goals,
                                         "relay_floor_us_per_line": floor_us, "phases": args.phases})
    print_table(["revision", "measure", *(f"run {i + 1}" for i in range(len(runs))), "median", "goal"],
                [[rev, k, *(r[rev][k] for r in runs), medians[rev][k], goals[k]] for rev, _ in revs for k in keys])
    if args.phases:
        print(f"{revs[-1][0]}, CPU per request by phase (main thread's clock, us; the probe's wrappers included):")
        print_table(["what", "calls", *(f"run {i + 1}" for i in range(len(runs))), "median"],
                    phase_table(runs, revs[-1][0]))
    print(f"floor: a bare uvloop relay spends {floor_us:.1f} us of CPU per line here; the {chunks} SSE events of a "
          f"request at that cost: {floor_us * chunks / 1e3:.2f} ms of the per-request figure")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
