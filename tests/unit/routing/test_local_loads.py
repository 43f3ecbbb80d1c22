"""A one-worker router's requests in flight (routing/local_loads.py): the engines above their heartbeat's load
kept as requests start and end and found again at each registry read, and every policy's decision the same
with only those as with every count."""

from __future__ import annotations

import random

import pytest

from tessera.routing import policies
from tessera.routing.local_loads import LocalLoads
from tessera.routing.policies import make_policy, policy_names
from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot


def above(counts: dict[str, int], heartbeat: dict[str, int]) -> dict[str, int]:
    return {engine_id: n for engine_id, n in counts.items() if n > heartbeat.get(engine_id, 0)}


def test_the_engines_above_their_heartbeat_follow_every_start_end_and_registry_read() -> None:
    rng = random.Random(7)
    engine_ids = [f"e{i}" for i in range(12)]
    loads = LocalLoads()
    counts: dict[str, int] = {}
    heartbeat: dict[str, int] = {}
    for step in range(3000):
        if step % 200 == 0:  # a registry read: heartbeats that caught up with some requests, missed others
            heartbeat = {e: rng.randrange(6) for e in engine_ids if rng.random() < 0.9}
            loads.heartbeats(heartbeat)
        engine_id = rng.choice(engine_ids)
        if counts.get(engine_id) and rng.random() < 0.5:
            counts[engine_id] -= 1
            if not counts[engine_id]:
                del counts[engine_id]
            loads.add(engine_id, -1)
        else:
            counts[engine_id] = counts.get(engine_id, 0) + 1
            loads.add(engine_id, 1)
        assert loads.counts == counts
        assert loads.above_heartbeat == above(counts, heartbeat)


def test_before_the_first_registry_read_every_count_is_above() -> None:
    loads = LocalLoads()
    loads.add("a", 1)
    loads.add("a", 1)
    assert loads.above_heartbeat == {"a": 2}
    loads.heartbeats({"a": 2})
    assert loads.above_heartbeat == {}
    loads.add("a", 1)
    assert loads.above_heartbeat == {"a": 3}
    loads.add("a", -1)
    loads.add("a", -2)
    assert loads.counts == {} and loads.above_heartbeat == {}


def test_every_policy_decides_the_same_with_only_the_engines_above_their_heartbeat(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The reason a one-worker router may leave the others out of the snapshot: each policy reads an engine's
    # load as max(heartbeat, in flight). Two instances of each policy see the same requests, one every count,
    # the other only those above the heartbeat; their random tie-breaks are seeded alike.
    unseeded = random.Random
    monkeypatch.setattr(policies.random, "Random", lambda seed=None: unseeded(1234 if seed is None else seed))
    rng = unseeded(11)
    left_out = 0
    for name in policy_names():
        full, partial = make_policy(name), make_policy(name)
        for trial in range(300):
            num_engines = rng.randrange(2, 40)
            engines = tuple(EngineView(f"e{i}", "", rng.randrange(5), rng.randrange(3), rng.random(), 1000, 16,
                                       rng.random() < 0.05) for i in range(num_engines))
            counts = {e.engine_id: rng.randrange(1, 9) for e in engines if rng.random() < 0.4}
            heartbeat = {e.engine_id: e.load for e in engines}
            cached = {e.engine_id: rng.randrange(1, 8) for e in engines if rng.random() < 0.1}
            chain = tuple(rng.getrandbits(64) for _ in range(8)) if trial % 3 else (rng.getrandbits(8),)
            request = RouteRequest("t", "m", 16 * len(chain) + 5, chain, prompt_prefix=f"p{rng.randrange(9)}",
                                   session_id=f"s{rng.randrange(5)}")
            assert full(RouteSnapshot(engines, cached, counts), request) == \
                partial(RouteSnapshot(engines, cached, above(counts, heartbeat)), request), (name, trial)
            left_out += len(counts) - len(above(counts, heartbeat))
    assert left_out > 1000  # most trials left engines out
