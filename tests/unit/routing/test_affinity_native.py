"""prefix_affinity's usual decision in C (routing/_affinity_rank.c via affinity_native.py) against the policy's
Python (its twin, routing/policies.py): for every decision, the same ranking, reason and expected tokens, and
the same placements after (two instances fed the same sequence of snapshots, so a placement recorded
differently shows as a later decision that differs)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from types import MappingProxyType

import pytest

from tessera.routing import affinity_native, policies
from tessera.routing.pod_view import PodWaits
from tessera.routing.policies import PolicyFn, make_policy
from tessera.routing.prefill_clock import PrefillFit
from tessera.routing.snapshot import EngineView, RouteDecision, RouteRequest, RouteSnapshot
from tests.support.native_build import skip_where_nothing_can_be_built


@pytest.fixture(autouse=True)
def _built() -> None:
    skip_where_nothing_can_be_built()
    assert affinity_native.NATIVE_FLEET is not None, "tessera.routing._affinity_rank did not build: run make install"


@contextmanager
def python_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fleets made inside decide without the C step (the policy's Python path for every decision)."""
    with monkeypatch.context() as patch:
        patch.setattr(policies, "native_fleet", lambda *args: None)
        yield


REASON_OUTCOMES = (("prefix_affinity sooner elsewhere", policies.MOVED),
                   ("prefix_affinity miss: pending where it was sent", policies.PENDING),
                   ("prefix_affinity miss: new prefix", policies.PLACED_BY_LOAD))


def outcome_of(decision: RouteDecision) -> int:
    return next((outcome for prefix, outcome in REASON_OUTCOMES if decision.reason.startswith(prefix)), policies.PLAIN)


class Counting:
    """Counts the decisions the C step took (and their outcomes) and those it handed back."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.taken = self.handed_back = 0
        self.outcomes: set[int] = set()
        self.last: tuple[RouteDecision, str | None] | None = None
        real = policies.rank_natively

        def counted(*args: object) -> tuple[RouteDecision, str | None] | None:
            native = self.last = real(*args)  # type: ignore[arg-type]
            if native is None:
                self.handed_back += 1
            else:
                self.taken += 1
                self.outcomes.add(outcome_of(native[0]))
            return native

        monkeypatch.setattr(policies, "rank_natively", counted)


def fleet_of(rng: random.Random, size: int, pressured: float) -> tuple[EngineView, ...]:
    return tuple(EngineView(f"e{i:04d}", f"http://e{i}", rng.randrange(5), rng.choice((0, 0, 0, 1, 3)), 0.0, 1000,
                            rng.choice((16, 16, 32)), rng.random() < pressured,
                            rng.choice((0, 0, 0, 700, 1500, 3000)))
                 for i in range(size))


def snapshots(rng: random.Random, fleet: tuple[EngineView, ...], keys: list[int], count: int,
              ) -> Iterator[tuple[RouteSnapshot, RouteRequest]]:
    """Decisions over one fleet: prefixes that repeat (placements pending, settled, followed), holders with and
    without credit, loads above the heartbeats' (some over the bound), waits as a dict or as the pod keeps them,
    with a prefill fit and without."""
    ids = [e.engine_id for e in fleet]
    for _ in range(count):
        holders = rng.sample(ids, rng.choice((0, 0, 1, 1, 2, 3, 6)))
        cached = {e: rng.choice((0, 1, 3, 20, 64)) for e in holders}
        if rng.random() < 0.1:
            cached["gone"] = 5  # an engine the fleet lacks
        busy = rng.sample(ids, rng.choice((0, 1, 3, len(ids) // 4)))
        in_flight = {e: rng.choice((1, 2, 5, 30)) for e in busy}
        pending = {e: rng.choice((0, 900, 2500)) for e in busy}
        waits_s = {e: rng.choice((0.0, 0.002, 0.05, 0.4)) for e in rng.sample(ids, rng.choice((0, 2, len(ids) // 3)))}
        if rng.random() < 0.5:
            now = rng.randrange(-2**31, 2**31)
            # Stamps around the reader's, past ones too (they count nothing), wrapping round 2**32.
            stamps = {e: {row: (now + int((s - rng.choice((0.0, 0.0, 0.03))) * 1e6) + 2**31) % 2**32 - 2**31
                          for row in range(rng.choice((1, 2, 3)))}
                      for e, s in waits_s.items()}
            waits: object = PodWaits(stamps, now)
        else:
            waits = waits_s
        fit = rng.choice((None, PrefillFit(0.01, 2e-4), PrefillFit(0.0, 5e-6)))
        prompt = rng.choice((3, 15, 16, 17, 300, 1025, 4000))
        chain = (rng.choice(keys), 1, 2) if rng.random() < 0.9 else ()
        session = rng.choice((None, "s1", "s2"))
        yield (RouteSnapshot(fleet, cached, in_flight, pending, waits, fit),  # type: ignore[arg-type]
               RouteRequest(rng.choice(("t1", "t2")), "m", prompt, chain, session_id=session))


def decide_both(native: PolicyFn, python: PolicyFn, snapshot: RouteSnapshot, request: RouteRequest,
                monkeypatch: pytest.MonkeyPatch) -> tuple[RouteDecision, RouteDecision]:
    got = native(snapshot, request)
    with python_only(monkeypatch):
        want = python(snapshot, request)
    return got, want


@pytest.mark.parametrize("size", [17, 33, 64, 200, 1000])
def test_the_c_step_decides_as_the_python_policy(size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    counting = Counting(monkeypatch)
    rng = random.Random(size)
    decisions = 0
    for trial in range(12 if size < 1000 else 3):
        fleet = fleet_of(rng, size, 0.5 if trial % 4 == 3 else 0.03)
        native, python = make_policy("prefix_affinity"), make_policy("prefix_affinity")
        keys = [rng.getrandbits(64) for _ in range(5)]
        for snapshot, request in snapshots(rng, fleet, keys, 60):
            got, want = decide_both(native, python, snapshot, request, monkeypatch)
            assert got == want, (trial, snapshot, request)
            decisions += 1
    # Both sides of the line between C and Python were crossed; past 32 engines the C side most often (at 17 the
    # walk meets 16 open engines only where at most one is closed).
    assert counting.taken > (decisions // 2 if size > 32 else 0) and counting.handed_back > 0


def test_every_outcome_of_the_c_step_is_met_and_agrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over a long sequence on one 64-engine fleet the C step takes every kind of decision (plain, moved sooner
    elsewhere, following a pending placement, a new prefix placed by backlog), each as Python takes it."""
    counting = Counting(monkeypatch)
    rng = random.Random(7)
    fleet = fleet_of(rng, 64, 0.03)
    native, python = make_policy("prefix_affinity"), make_policy("prefix_affinity")
    keys = [rng.getrandbits(64) for _ in range(8)]
    for snapshot, request in snapshots(rng, fleet, keys, 1500):
        got, want = decide_both(native, python, snapshot, request, monkeypatch)
        assert got == want
    assert counting.taken > 1000
    assert counting.outcomes == {policies.PLAIN, policies.MOVED, policies.PENDING, policies.PLACED_BY_LOAD}


def test_the_c_step_reports_each_outcome(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each outcome of the C step, made on purpose on a 20-engine fleet with one request running on each."""
    counting = Counting(monkeypatch)
    fleet = tuple(EngineView(f"e{i:02d}", "u", 1, 0, 0.0, 1000, 16) for i in range(20))
    ids = tuple(e.engine_id for e in fleet)
    policy = make_policy("prefix_affinity")
    fresh = RouteRequest("t", "m", 1000, (42, 1))
    first = policy(RouteSnapshot(fleet), fresh)
    # A new prefix: the open home with the shortest backlog, all alike here, so its first home.
    assert first.reason == "prefix_affinity miss: new prefix, shortest backlog of its homes load=1"
    assert first.ranked[0] == policies.prefix_homes(ids, 42)[0] and len(first.ranked) == 16
    assert counting.last is not None and counting.last[1] == first.ranked[0]
    again = policy(RouteSnapshot(fleet), fresh)
    assert again.reason == "prefix_affinity miss: pending where it was sent, load=1"
    assert again.ranked[0] == first.ranked[0] and outcome_of(counting.last[0]) == policies.PENDING
    holder = first.ranked[0]
    hit = policy(RouteSnapshot(fleet, {holder: 10}), fresh)
    assert hit.reason == "prefix_affinity cached_tokens=160 load=1" and hit.expected_cached_tokens == 160
    assert counting.last[1] == ""  # settled
    moved = policy(RouteSnapshot(fleet, {holder: 10}, prefill_wait_s={holder: 2.0},
                                 prefill_fit=PrefillFit(0.0, 1e-3)), fresh)
    assert moved.reason == ("prefix_affinity sooner elsewhere: holder's prefill wait 2000.0 ms, "
                            "cached_tokens=0 load=1")
    assert moved.ranked[:2] == (hit.ranked[1], holder) and outcome_of(counting.last[0]) == policies.MOVED
    homes = policies.prefix_homes(ids, 77)
    backlog = {engine_id: 4096 for engine_id in ids}
    backlog[homes[3]] = 0
    placed = policy(RouteSnapshot(fleet, local_pending_prefill_tokens=backlog), RouteRequest("t", "m", 1000, (77,)))
    assert placed.ranked[0] == homes[3] and outcome_of(counting.last[0]) == policies.PLACED_BY_LOAD
    assert counting.taken == 5 and counting.handed_back == 0


def test_a_small_fleet_or_a_crowded_walk_is_left_to_python(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = Counting(monkeypatch)
    small = tuple(EngineView(f"e{i}", "u", 0, 0, 0.0, 1000, 16) for i in range(5))
    crowded = tuple(EngineView(f"e{i}", "u", 0, 0, 0.0, 1000, 16, under_pressure=i % 3 != 0) for i in range(40))
    native, python = make_policy("prefix_affinity"), make_policy("prefix_affinity")
    for fleet in (small, crowded):
        got, want = decide_both(native, python, RouteSnapshot(fleet), RouteRequest("t", "m", 100, (1,)), monkeypatch)
        assert got == want
    assert counting.taken == 0 and counting.handed_back == 2


def test_bad_arguments_raise_type_errors() -> None:
    rank = policies.rank_natively
    make_ring, make_fleet = affinity_native.NATIVE_RING, affinity_native.NATIVE_FLEET
    assert make_ring is not None and make_fleet is not None
    constants = tuple(policies._CONSTANTS)
    with pytest.raises(TypeError, match="5 arguments"):
        rank(None)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="agree"):
        make_ring([1, 2], [(0,)], [[0]])
    with pytest.raises(ValueError, match="names an engine the ring lacks"):
        make_ring([1], [(3,)], [[0]])
    with pytest.raises(ValueError, match="past the ring's points"):
        make_ring([1], [(0,)], [[5]])
    ring = make_ring([1], [(0,)], [[0]])
    with pytest.raises(TypeError, match="must agree"):
        make_fleet(("a", "b"), {"a": 0, "b": 1}, [0, 0], [0, 0], [16, 16], [False, False], [0, 0], ring, constants)
    with pytest.raises(ValueError, match="invalid PyCapsule"):
        make_fleet(("a",), {"a": 0}, [0], [0], [16], [False], [0], object(), constants)
    fleet = make_fleet(("a",), {"a": 0}, [0], [0], [16], [False], [0], ring, constants)
    with pytest.raises(TypeError, match="must be a RouteSnapshot"):
        rank(fleet, ("not", "a", "snapshot"), 10, 1, None)  # type: ignore[arg-type]
    views = (EngineView("a", "u", 0, 0, 0.0, 1000, 16),)
    # One engine: fewer open than 16, so the Python policy decides.
    assert rank(fleet, RouteSnapshot(views), 10, 1, None) is None


def test_mappings_of_another_kind_go_to_python_and_empty_ones_read_as_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    counting = Counting(monkeypatch)
    fleet = tuple(EngineView(f"e{i:02d}", "u", 1, 0, 0.0, 1000, 16) for i in range(20))
    native, python = make_policy("prefix_affinity"), make_policy("prefix_affinity")
    request = RouteRequest("t", "m", 1000, (5, 1))
    for snapshot in (RouteSnapshot(fleet, MappingProxyType({"e03": 4})), RouteSnapshot(fleet),
                     RouteSnapshot(fleet, {"e03": 4}, MappingProxyType({}))):
        got, want = decide_both(native, python, snapshot, request, monkeypatch)
        assert got == want
    assert counting.handed_back == 1 and counting.taken == 2


def test_a_bad_value_midway_leaves_the_fleets_scratch_as_it_was() -> None:
    """The C step keeps per-decision loads and credits in the fleet's arrays and resets them before it returns:
    an exception halfway (a count that is not an int) must not leave one engine's load raised for the next."""
    rank = policies.rank_natively
    views = tuple(EngineView(f"e{i:02d}", "u", 0, 0, 0.0, 1000, 16) for i in range(20))
    fleet = policies._Fleet.of(views).native
    before = rank(fleet, RouteSnapshot(views), 10_000, 99, None)
    assert before is not None
    bad_count: dict[str, int] = {"e00": 40, "e01": 40, "e02": "many"}  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        rank(fleet, RouteSnapshot(views, {}, bad_count), 10_000, 99, None)
    bad_blocks: dict[str, int] = {"e04": 3, "e05": None}  # type: ignore[dict-item]
    with pytest.raises(TypeError):
        rank(fleet, RouteSnapshot(views, bad_blocks, {"e03": 40}), 10_000, 99, None)
    assert rank(fleet, RouteSnapshot(views), 10_000, 99, None) == before
