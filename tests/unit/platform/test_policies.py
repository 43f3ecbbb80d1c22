"""Routing policies on hand-made snapshots."""

from __future__ import annotations

import pytest

from tessera.routing.policies import BOUND_FACTOR, make_policy, policy_names
from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot


def engine(engine_id: str, running: int = 0, waiting: int = 0, pressure: bool = False,
           kv: float = 0.0) -> EngineView:
    return EngineView(engine_id, f"http://{engine_id}", running, waiting, kv, 1000, 32, pressure)


REQ = RouteRequest(tenant="t", model="m", num_prompt_tokens=320, block_hashes=tuple(range(10)))


def test_registry_lists_all_policies_and_rejects_unknown() -> None:
    assert policy_names() == ["approx_prefix", "least_loaded", "prefix_affinity", "round_robin",
                              "session_affinity"]
    with pytest.raises(ValueError, match="valid: approx_prefix, least_loaded"):
        make_policy("random")


@pytest.mark.parametrize("name", ["approx_prefix", "least_loaded", "prefix_affinity", "round_robin",
                                  "session_affinity"])
def test_empty_fleet_gives_no_engine(name: str) -> None:
    decision = make_policy(name)(RouteSnapshot(()), REQ)
    assert decision.ranked == () and "no live engine" in decision.reason


@pytest.mark.parametrize("name", ["approx_prefix", "least_loaded", "prefix_affinity", "round_robin",
                                  "session_affinity"])
def test_every_policy_ranks_every_engine_and_pressure_last(name: str) -> None:
    snap = RouteSnapshot((engine("a", pressure=True), engine("b"), engine("c")))
    decision = make_policy(name)(snap, REQ)
    assert sorted(decision.ranked) == ["a", "b", "c"]
    assert decision.ranked[-1] == "a"


def test_round_robin_cycles_in_id_order() -> None:
    policy = make_policy("round_robin")
    snap = RouteSnapshot((engine("b"), engine("a"), engine("c")))
    assert [policy(snap, REQ).ranked[0] for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_ties_break_by_kv_usage_then_id() -> None:
    policy = make_policy("least_loaded")
    snap = RouteSnapshot((engine("b", 1), engine("a", 1), engine("c", 0, 2)))
    assert policy(snap, REQ).ranked == ("a", "b", "c")
    snap = RouteSnapshot((engine("b", 1, kv=0.1), engine("a", 1, kv=0.5)))
    assert policy(snap, REQ).ranked == ("b", "a")


def test_least_loaded_counts_this_gateways_in_flight_requests() -> None:
    policy = make_policy("least_loaded")
    snap = RouteSnapshot((engine("a"), engine("b")), local_in_flight={"a": 3})
    assert policy(snap, REQ).ranked[0] == "b"


def test_session_affinity_is_sticky_and_survives_other_engines_leaving() -> None:
    policy = make_policy("session_affinity")
    req = RouteRequest("t", "m", 10, session_id="user-42")
    full = RouteSnapshot(tuple(engine(x) for x in "abcdef"))
    chosen = policy(full, req).ranked[0]
    assert all(policy(full, req).ranked[0] == chosen for _ in range(5))
    others = [e for e in full.engines if e.engine_id != chosen][:2]
    smaller = RouteSnapshot((*others, next(e for e in full.engines if e.engine_id == chosen)))
    assert policy(smaller, req).ranked[0] == chosen


def test_prefix_affinity_prefers_the_engine_holding_the_prefix() -> None:
    policy = make_policy("prefix_affinity")
    snap = RouteSnapshot((engine("a", 1), engine("b", 0)), cached_prefix_blocks={"a": 8})
    decision = policy(snap, REQ)
    assert decision.ranked[0] == "a"
    assert decision.expected_cached_tokens == 8 * 32
    assert "cached_tokens=256" in decision.reason


def test_prefix_affinity_without_hits_is_least_loaded() -> None:
    policy = make_policy("prefix_affinity")
    snap = RouteSnapshot((engine("a", 2), engine("b", 1)))
    decision = policy(snap, REQ)
    assert decision.ranked[0] == "b" and "miss" in decision.reason


def test_prefix_affinity_bounded_load_stops_a_hot_prefix_overloading_one_engine() -> None:
    policy = make_policy("prefix_affinity")
    # mean load = (9 + 0 + 0) / 3 = 3; bound = 1.25 * 3 + 1 = 4.75 < 9: the holder is over the bound.
    snap = RouteSnapshot((engine("a", 9), engine("b"), engine("c")), cached_prefix_blocks={"a": 10})
    decision = policy(snap, REQ)
    assert decision.ranked[0] in ("b", "c")
    assert "bounded_load" in decision.reason
    assert BOUND_FACTOR == 1.25


def test_prefix_affinity_trades_cached_tokens_against_queueing() -> None:
    policy = make_policy("prefix_affinity")
    # a holds 1 block (32 tokens) but has 1 more request queued than b: queueing wins.
    snap = RouteSnapshot((engine("a", 2), engine("b", 1), engine("c", 1)), cached_prefix_blocks={"a": 1})
    assert policy(snap, REQ).ranked[0] in ("b", "c")


def test_prefix_affinity_pressure_flag_beats_cache_hits() -> None:
    policy = make_policy("prefix_affinity")
    snap = RouteSnapshot((engine("a", pressure=True), engine("b")), cached_prefix_blocks={"a": 10})
    assert policy(snap, REQ).ranked == ("b", "a")


def test_approx_prefix_remembers_where_it_sent_a_prefix() -> None:
    policy = make_policy("approx_prefix")
    text = "system prompt " * 40
    req = RouteRequest("t", "m", 100, prompt_prefix=text)
    snap = RouteSnapshot((engine("a"), engine("b")))
    first = policy(snap, req).ranked[0]
    busier = RouteSnapshot(tuple(engine(e.engine_id, 1 if e.engine_id == first else 0) for e in snap.engines))
    decision = policy(busier, req)
    assert decision.ranked[0] == first and "matched_chunks" in decision.reason


def test_approx_prefix_forgets_dead_engines() -> None:
    policy = make_policy("approx_prefix")
    req = RouteRequest("t", "m", 100, prompt_prefix="x" * 600)
    first = policy(RouteSnapshot((engine("a"), engine("b"))), req).ranked[0]
    survivor = "b" if first == "a" else "a"
    assert policy(RouteSnapshot((engine(survivor),)), req).ranked == (survivor,)
