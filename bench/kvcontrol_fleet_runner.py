"""The engine side of ``bench_kvcontrol.py --engines N``: a fleet of simulated engines in this process
(engine/sim/fleet.py: registered in Redis, answering the controller's /stats and /requests polls, one ZMQ
PUB socket each), publishing KV events in vLLM's wire format at a scheduled rate.

Two sources of events:

- ``replay`` (default): each engine publishes ``rate`` batches per second (a real engine publishes one
  batch per step; a busy H100 replica steps ~100 times a second) drawn from a busy engine's mix: a share
  of steps prefill a new request (BlockStored of 1..``--max-prefill-blocks`` blocks, the first salted with
  one of the tenants' cache salts), the others decode (``--decode-blocks`` sequences each complete one block,
  a BlockStored extending its chain), and once ``--capacity-blocks`` are cached, each store first evicts the
  oldest blocks (BlockRemoved before the stores, as vLLM evicts while allocating). Through the fleet's own
  publishers (``KVEventPublisher``: the same socket, sequence numbers and encoding as a simulated engine).
- ``sim``: the simulated engines themselves under load (``rate`` requests per second per engine, Poisson,
  each a tenant's shared 512-token prefix plus 256 fresh tokens and 32 output tokens): their real block
  pools publish what vLLM would, at whatever rate this process can simulate.

Protocol with the bench: writes ``--ready-file`` once the fleet serves; waits for ``--go-file``; then runs the
schedule (``--warmup`` s at the first rate, then ``--step`` s at each rate) and writes what it published per
window to ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from collections import deque
from pathlib import Path
from typing import Any

from tessera.engine.protocol import GenerateRequest
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.engine import RequestStream
from tessera.engine.sim.fleet import SimFleet, SimReplica
from tessera.engine.sim.kv_wire import MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent
from tessera.engine.sim.step_time import MeasuredStepTime

MODEL = "sim-kvcontrol"
BLOCK_SIZE = 16
TICK_S = 0.005
TOKENS = [7] * (BLOCK_SIZE * 256)  # token ids of the synthetic blocks (the ledger never reads them)


class SyntheticEvents:
    """One engine's batches of a busy engine's event mix (see the module docstring)."""

    def __init__(self, rng: random.Random, salts: list[str], capacity_blocks: int, prefill_share: float,
                 max_prefill_blocks: int, decode_blocks: int, num_running: int = 64) -> None:
        self.rng = rng
        self.salts = salts
        self.capacity_blocks = capacity_blocks
        self.prefill_share = prefill_share
        self.max_prefill_blocks = max_prefill_blocks
        self.decode_blocks = decode_blocks
        self.resident: deque[int] = deque()
        self.tails: list[int | None] = [None] * num_running  # each running sequence's last full block

    def _new_hashes(self, n: int) -> list[int]:
        return [self.rng.getrandbits(63) for _ in range(n)]

    def next_batch(self) -> tuple[list[KVEvent], int]:
        """(events, block operations in them)."""
        stores: list[BlockStored] = []
        if self.rng.random() < self.prefill_share:
            k = self.rng.randint(1, self.max_prefill_blocks)
            hashes = self._new_hashes(k)
            stores.append(BlockStored(hashes, None, TOKENS[:k * BLOCK_SIZE], BLOCK_SIZE, None, MEDIUM_GPU, None,
                                      extra_keys=[(self.rng.choice(self.salts),)] + [None] * (k - 1)))
            self.tails[self.rng.randrange(len(self.tails))] = hashes[-1]
        else:
            for slot in self.rng.sample(range(len(self.tails)), self.decode_blocks):
                parent = self.tails[slot]
                if parent is None:
                    continue
                (h,) = self._new_hashes(1)
                stores.append(BlockStored([h], parent, TOKENS[:BLOCK_SIZE], BLOCK_SIZE, None, MEDIUM_GPU, None))
                self.tails[slot] = h
        num_new = sum(len(s.block_hashes) for s in stores)
        events: list[KVEvent] = []
        overflow = len(self.resident) + num_new - self.capacity_blocks
        if overflow > 0:
            events.append(BlockRemoved([self.resident.popleft() for _ in range(overflow)], MEDIUM_GPU))
        for s in stores:
            self.resident.extend(s.block_hashes)
        events.extend(stores)
        return events, num_new + max(0, overflow)


async def replay(replicas: list[SimReplica], args: argparse.Namespace, rate: float, until: float,
                 gens: list[SyntheticEvents]) -> tuple[int, int]:
    """Publishes ``rate`` batches per second per engine until ``until`` (monotonic); (batches, events)."""
    owed = [0.0] * len(replicas)
    num_batches = num_events = 0
    last = time.monotonic()
    while (now := time.monotonic()) < until:
        dt, last = now - last, now
        for i, replica in enumerate(replicas):
            owed[i] += rate * dt
            while owed[i] >= 1.0:
                owed[i] -= 1.0
                events, n = gens[i].next_batch()
                if events:  # an engine whose sequences have no full block yet publishes nothing
                    replica.publisher.publish(time.time(), events)
                    num_batches += 1
                    num_events += n
        await asyncio.sleep(TICK_S)
    return num_batches, num_events


async def load(replicas: list[SimReplica], rate: float, until: float, rng: random.Random, salts: list[str],
               prefixes: dict[str, list[int]], open_streams: list[tuple[SimReplica, RequestStream]]) -> tuple[int, int]:
    """Adds Poisson requests (``rate`` per second per engine) straight to the engines until ``until``; returns
    (batches, 0): the events are counted by the controller (the engines publish them themselves)."""
    before = sum(r.publisher.num_batches for r in replicas)
    last = time.monotonic()
    n = 0
    while (now := time.monotonic()) < until:
        dt, last = now - last, now
        for replica in replicas:
            arrivals = sum(1 for _ in range(8) if rng.random() < rate * dt / 8)
            for _ in range(arrivals):
                salt = rng.choice(salts)
                prompt = prefixes[salt] + [rng.randrange(100, 30000) for _ in range(256)]
                n += 1
                stream = replica.engine.add(GenerateRequest(request_id=f"r{n}", prompt_token_ids=prompt,
                                                            max_tokens=32, ignore_eos=True, cache_salt=salt))
                open_streams.append((replica, stream))
        still = [(r, s) for r, s in open_streams if not s.done]
        for replica, stream in open_streams:
            if stream.done:
                replica.engine.release(stream)
        open_streams[:] = still
        await asyncio.sleep(0.02)
    return sum(r.publisher.num_batches for r in replicas) - before, 0


async def main_async(args: argparse.Namespace) -> None:
    config = SimEngineConfig(
        served_model_name=MODEL, block_size=BLOCK_SIZE, num_gpu_blocks=args.capacity_blocks + 1, max_model_len=2048,
        max_num_seqs=64, step_time=MeasuredStepTime(step_s=0.01, per_seq_s=0.0001, per_prefill_token_s=2e-6),
        heartbeat_interval_s=1.0,
        # The prefix-index feed is the gateways' concern and would share this process's core with the engines.
        feed_index=False)
    fleet = await SimFleet(config, args.engines, args.redis_url, "kvc").start()
    salts = args.salts.split(",")
    rng = random.Random(args.seed)
    gens = [SyntheticEvents(random.Random(args.seed * 1000 + i), salts, args.capacity_blocks, args.prefill_share,
                            args.max_prefill_blocks, args.decode_blocks) for i in range(args.engines)]
    prefixes = {salt: [rng.randrange(100, 30000) for _ in range(512)] for salt in salts}
    open_streams: list[tuple[SimReplica, RequestStream]] = []
    Path(args.ready_file).write_text(json.dumps([r.engine_id for r in fleet.replicas]))
    try:
        while not Path(args.go_file).exists():
            await asyncio.sleep(0.1)
        rates = [float(r) for r in args.rates.split(",")]
        schedule = [(rates[0], args.warmup, "warmup")] + [(rate, args.step, "measured") for rate in rates]
        windows: list[dict[str, Any]] = []
        for rate, seconds, kind in schedule:
            start_wall, start = time.time(), time.monotonic()
            if args.source == "replay":
                batches, events = await replay(fleet.replicas, args, rate, start + seconds, gens)
            else:
                batches, events = await load(fleet.replicas, rate, start + seconds, rng, salts, prefixes, open_streams)
            windows.append({"kind": kind, "rate": rate, "start": start_wall, "end": time.time(),
                            "published_batches": batches, "published_events": events,
                            "loadavg_1m": os.getloadavg()[0]})
            print(f"[fleet] {kind} rate {rate}: {batches} batches, {events} events in {time.monotonic() - start:.1f} s",
                  flush=True)
        Path(args.out).write_text(json.dumps(windows))
    finally:
        await fleet.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, required=True)
    parser.add_argument("--redis-url", required=True)
    parser.add_argument("--source", choices=("replay", "sim"), default="replay")
    parser.add_argument("--rates", required=True, help="per engine: batches/s (replay) or requests/s (sim)")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--step", type=float, default=20.0)
    parser.add_argument("--salts", required=True, help="the tenants' cache salts, comma-separated")
    parser.add_argument("--capacity-blocks", type=int, default=4096)
    parser.add_argument("--prefill-share", type=float, default=0.1)
    parser.add_argument("--max-prefill-blocks", type=int, default=64)
    parser.add_argument("--decode-blocks", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--go-file", required=True)
    parser.add_argument("--out", required=True)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
