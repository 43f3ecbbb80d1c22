"""Only the engines whose requests in flight exceed their heartbeat's load reach a policy (routing/pod_view.py):
kept as requests start and end and found again at each registry read, and every policy's decision the same
with only those as with every count."""

from __future__ import annotations

import random

import pytest

from tessera.routing import policies
from tessera.routing.pod_in_flight import PodInFlight
from tessera.routing.pod_view import PodEngines
from tessera.routing.policies import make_policy, policy_names
from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot


def above(counts: dict[str, int], heartbeat: dict[str, int]) -> dict[str, int]:
    return {engine_id: n for engine_id, n in counts.items() if n > heartbeat.get(engine_id, 0)}


def test_the_engines_above_their_heartbeat_follow_every_start_end_and_registry_read() -> None:
    """A one-worker router's own table (``PodInFlight.private``), as the router reads it at each decision."""
    rng = random.Random(7)
    engine_ids = [f"e{i}" for i in range(12)]
    loads = PodInFlight.private()
    counts: dict[str, int] = {}
    heartbeat: dict[str, int] = {}
    engines = PodEngines(engine_ids, heartbeat)
    for step in range(3000):
        if step % 200 == 0:  # a registry read: heartbeats that caught up with some requests, missed others
            heartbeat = {e: rng.randrange(6) for e in engine_ids if rng.random() < 0.9}
            engines = PodEngines(engine_ids, heartbeat)
        engine_id = rng.choice(engine_ids)
        if counts.get(engine_id) and rng.random() < 0.5:
            counts[engine_id] -= 1
            if not counts[engine_id]:
                del counts[engine_id]
            loads.add(engine_id, -1, 0)
        else:
            counts[engine_id] = counts.get(engine_id, 0) + 1
            loads.add(engine_id, 1, 0)
        assert dict(loads.totals(engines, 0.0).requests) == above(counts, heartbeat)


def test_before_the_first_registry_read_every_count_is_above() -> None:
    loads = PodInFlight.private()
    unread = PodEngines(["a"])  # a read without heartbeats: every load 0
    loads.add("a", 1, 0)
    loads.add("a", 1, 0)
    assert dict(loads.totals(unread, 0.0).requests) == {"a": 2}
    read = PodEngines(["a"], {"a": 2})
    assert dict(loads.totals(read, 0.0).requests) == {}
    loads.add("a", 1, 0)
    assert dict(loads.totals(read, 0.0).requests) == {"a": 3}
    loads.add("a", -1, 0)
    loads.add("a", -2, 0)
    assert dict(loads.totals(read, 0.0).requests) == {} and loads._own[0] == 0


def test_every_policy_decides_the_same_with_only_the_engines_above_their_heartbeat(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The reason a router may leave the others out of the snapshot: each policy reads an engine's
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
