"""Routing policies (tessera/routing/policies.py) on hand-made snapshots: the registry, each policy's basic
order, ties, dead engines and the bounded-load rule."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import replace

import pytest

from tessera.routing import policies
from tessera.routing.policies import APPROX_CHUNK_CHARS, BOUND_FACTOR, make_policy, policy_names
from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot


def engine(engine_id: str, running: int = 0, waiting: int = 0, kv: float = 0.0, pressure: bool = False,
           block_size: int = 32) -> EngineView:
    return EngineView(engine_id, f"http://{engine_id}", running, waiting, kv, 1000, block_size, pressure)


REQ = RouteRequest(tenant="t", model="m", num_prompt_tokens=1000, block_hashes=tuple(range(31)))
REQ_320 = RouteRequest(tenant="t", model="m", num_prompt_tokens=320, block_hashes=tuple(range(10)))


@pytest.mark.parametrize("name", policy_names())
def test_an_engine_missing_from_the_snapshot_is_never_ranked(name: str) -> None:
    # The router passes live engines only; a dead engine's index entries must not leak into the ranking.
    snap = RouteSnapshot((engine("a"), engine("b")), cached_prefix_blocks={"dead": 31}, local_in_flight={"dead": 4})
    decision = make_policy(name)(snap, RouteRequest("t", "m", 1000, REQ.block_hashes, "x" * 300, "s"))
    assert sorted(decision.ranked) == ["a", "b"]
    assert decision.expected_cached_tokens == 0


def test_prefix_affinity_equal_holders_go_to_the_less_loaded_then_one_winner_per_prefix() -> None:
    cached = {"a": 10, "b": 10, "c": 10}
    snap = RouteSnapshot((engine("a", 1), engine("b", 0, kv=0.5), engine("c", 0, kv=0.1)), cached)
    first = make_policy("prefix_affinity")(snap, REQ).ranked
    assert first[-1] == "a"
    # A tie between b and c is decided by the prefix itself: every gateway (policy instance) agrees.
    assert all(make_policy("prefix_affinity")(snap, REQ).ranked == first for _ in range(3))


def test_prefix_affinity_spreads_new_prefixes_over_an_idle_fleet() -> None:
    policy = make_policy("prefix_affinity")
    snap = RouteSnapshot((engine("a"), engine("b"), engine("c")))
    winners = [policy(snap, RouteRequest("t", "m", 1000, (h, h + 1))).ranked[0] for h in range(0, 600, 10)]
    assert {w: winners.count(w) for w in "abc"}.keys() == {"a", "b", "c"}
    assert min(winners.count(w) for w in "abc") >= 10  # 60 prefixes: no engine is left out
    # ...while requests sharing a first block agree on their engine before the index has heard of it.
    assert len({policy(snap, RouteRequest("t", "m", 1000, (7, tail))).ranked[0] for tail in range(20)}) == 1


def test_prefix_affinity_prefers_the_longer_cached_prefix() -> None:
    policy = make_policy("prefix_affinity")
    snap = RouteSnapshot((engine("a"), engine("b"), engine("c")), {"a": 4, "b": 20})
    decision = policy(snap, REQ)
    assert decision.ranked[:2] == ("b", "a") and decision.expected_cached_tokens == 640


def test_prefix_affinity_counts_at_most_what_vllm_can_reuse() -> None:
    # A 320-token prompt fully cached: vLLM recomputes the last token, so the last block is prefilled again.
    policy = make_policy("prefix_affinity")
    req = RouteRequest("t", "m", 320, tuple(range(10)))
    decision = policy(RouteSnapshot((engine("a"),), {"a": 10}), req)
    assert decision.expected_cached_tokens == 288


def test_bounded_load_spills_a_hot_prefix_and_takes_it_back_when_load_evens_out() -> None:
    policy = make_policy("prefix_affinity")
    hot = {"a": 31}
    assert BOUND_FACTOR == 2.0
    # loads 4, 0, 0: mean 1.33, bound 3.67: a is over it and gets no credit for its cache.
    spilled = policy(RouteSnapshot((engine("a", 4), engine("b"), engine("c")), hot), REQ)
    assert spilled.ranked[0] in ("b", "c") and "bounded_load" in spilled.reason
    assert spilled.expected_cached_tokens == 0
    # loads 2, 2, 1: mean 1.67, bound 4.33: a is under it again and its 992 cached tokens win.
    back = policy(RouteSnapshot((engine("a", 2), engine("b", 2), engine("c", 1)), hot), REQ)
    assert back.ranked[0] == "a" and back.expected_cached_tokens == 992


def test_bounded_load_uses_this_gateways_in_flight_count_when_heartbeats_lag() -> None:
    policy = make_policy("prefix_affinity")
    snap = RouteSnapshot((engine("a"), engine("b"), engine("c")), {"a": 31}, local_in_flight={"a": 5})
    assert policy(snap, REQ).ranked[0] != "a"


def test_prefix_affinity_a_holder_under_the_bound_keeps_the_request_whatever_its_queue() -> None:
    # a: 2 running + 3 waiting (load 5), b and c: 4 running each: mean 4.33, bound 6.42, a is under it.
    # Priced in tokens, a's queue (64 x 5 + 512 x 3 = 1,856) outweighs its 992 cached tokens, and the policy
    # used to move the request: a full prefill on b, and a copy of the prefix evicting another there.
    policy = make_policy("prefix_affinity")
    snap = RouteSnapshot((engine("a", 2, waiting=3), engine("b", 4), engine("c", 4)), {"a": 31})
    decision = policy(snap, REQ)
    assert decision.ranked[0] == "a" and decision.expected_cached_tokens == 992
    assert "cached_tokens=992" in decision.reason


def test_round_robin_skips_a_dead_engine_without_losing_its_turn_order() -> None:
    policy = make_policy("round_robin")
    full = RouteSnapshot((engine("a"), engine("b"), engine("c")))
    assert policy(full, REQ).ranked[0] == "a"
    without_b = RouteSnapshot((engine("a"), engine("c")))
    assert {policy(without_b, REQ).ranked[0] for _ in range(2)} == {"a", "c"}


def test_session_affinity_without_a_session_is_least_loaded_with_ties_spread() -> None:
    policy = make_policy("session_affinity")
    snap = RouteSnapshot((engine("b"), engine("a"), engine("c", 1)))
    firsts = set()
    for _ in range(40):
        ranked = policy(snap, RouteRequest("t", "m", 10)).ranked
        assert ranked[2] == "c"
        firsts.add(ranked[0])
    assert firsts == {"a", "b"}


@pytest.mark.parametrize("seed", [str(seed) for seed in range(24)])
def test_tied_engines_share_decisions_evenly_under_every_string_hash_seed(seed: str) -> None:
    # Workers run with different string-hash seeds; under some, hash((salt, id)) made one of two tied engines win
    # 95 % of decisions. Each tied engine must win a fair share in every process.
    code = ("from tessera.routing.policies import make_policy\n"
            "from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot\n"
            "policy = make_policy('least_loaded')\n"
            "snap = RouteSnapshot(tuple(EngineView(i, 'http://' + i, 0, 0, 0.0, 1000, 32) for i in ('a', 'b')))\n"
            "print(sum(policy(snap, RouteRequest('t', 'm', 10)).ranked[0] == 'a' for _ in range(2000)))\n")
    wins = int(subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout)
    assert 800 < wins < 1200


def text_with_chunks(n: int, tag: str = "p") -> str:
    return "".join(f"{tag}{i:0{APPROX_CHUNK_CHARS - len(tag)}d}" for i in range(n))


def test_approx_prefix_narrows_to_the_engines_sharing_the_longest_prefix() -> None:
    policy = make_policy("approx_prefix")
    snap = RouteSnapshot((engine("a"), engine("b"), engine("c")))
    shared, tail_a, tail_b = text_with_chunks(3), text_with_chunks(2, "x"), text_with_chunks(2, "y")
    first = policy(snap, RouteRequest("t", "m", 10, prompt_prefix=shared + tail_a)).ranked[0]
    # The same shared part with another tail: least loaded among the engines that were sent `shared`.
    busy = RouteSnapshot(tuple(engine(e.engine_id, 3 if e.engine_id == first else 0) for e in snap.engines))
    second = policy(busy, RouteRequest("t", "m", 10, prompt_prefix=shared + tail_b))
    assert second.ranked[0] == first


def test_approx_prefix_keys_chunks_with_the_tenants_salt_and_reports_no_match() -> None:
    """Issue #15: a tenant could learn from ``x-tessera-route-reason`` (``matched_chunks=N``) whether another
    tenant had sent a prompt beginning with its guess. Chunks are keyed with the tenant's cache salt, so
    another tenant's traffic does not move its route, and the reason says nothing of the match."""
    policy = make_policy("approx_prefix")
    snap = RouteSnapshot((engine("a"), engine("b"), engine("c")))
    prompt = text_with_chunks(3)
    victim = policy(snap, RouteRequest("victim", "m", 10, prompt_prefix=prompt, cache_salt="salt-victim"))
    busy = RouteSnapshot(tuple(engine(e.engine_id, 3 if e.engine_id == victim.ranked[0] else 0)
                               for e in snap.engines))
    probe = policy(busy, RouteRequest("prober", "m", 10, prompt_prefix=prompt, cache_salt="salt-prober"))
    again = policy(busy, RouteRequest("victim", "m", 10, prompt_prefix=prompt, cache_salt="salt-victim"))
    assert probe.ranked[0] != victim.ranked[0]  # the least loaded: the victim's prefix is not the prober's
    assert again.ranked[0] == victim.ranked[0]  # the victim's own prefix still routes
    assert victim.reason == probe.reason == again.reason == "approx_prefix"
    # Tenants whose policy shares the prefix cache (no salt) share the chunks too, as they share KV blocks.
    shared = policy(snap, RouteRequest("x", "m", 10, prompt_prefix=text_with_chunks(3, "s")))
    busy = RouteSnapshot(tuple(engine(e.engine_id, 3 if e.engine_id == shared.ranked[0] else 0)
                               for e in snap.engines))
    assert policy(busy, RouteRequest("y", "m", 10, prompt_prefix=text_with_chunks(3, "s"))).ranked[0] == \
        shared.ranked[0]


def test_approx_prefix_keeps_sending_to_an_engine_after_it_evicted_the_prefix() -> None:
    # The baseline's defining weakness: it only knows where it sent a prefix, never what was evicted.
    policy = make_policy("approx_prefix")
    req = RouteRequest("t", "m", 10, prompt_prefix=text_with_chunks(4))
    first = policy(RouteSnapshot((engine("a"), engine("b"))), req).ranked[0]
    evicted = RouteSnapshot((engine("a", kv=1.0), engine("b", kv=1.0)), cached_prefix_blocks={})
    assert policy(evicted, req).ranked[0] == first


def test_approx_prefix_ignores_a_partial_chunk() -> None:
    policy = make_policy("approx_prefix")
    req = RouteRequest("t", "m", 10, prompt_prefix="x" * (APPROX_CHUNK_CHARS - 1))
    assert policy(RouteSnapshot((engine("a"), engine("b", 1))), req).ranked[0] == "a"
    # Nothing was remembered: the next one goes to the least loaded, not after the first.
    assert policy(RouteSnapshot((engine("a", 1), engine("b"))), req).ranked[0] == "b"


def test_a_prefixs_homes_are_the_same_in_every_gateway_process() -> None:
    # Gateway processes run with different string-hash seeds; the prefix's engine must not depend on it.
    code = "from tessera.routing.policies import prefix_homes; print(prefix_homes(('a', 'b', 'c', 'd'), 12345))"
    outputs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                              capture_output=True, text=True, check=True).stdout for seed in ("1", "2")}
    assert len(outputs) == 1


def test_registry_lists_all_policies_and_rejects_unknown() -> None:
    assert policy_names() == ["approx_prefix", "least_loaded", "prefix_affinity", "round_robin",
                              "session_affinity"]
    with pytest.raises(ValueError, match="valid: approx_prefix, least_loaded"):
        make_policy("random")


@pytest.mark.parametrize("name", ["approx_prefix", "least_loaded", "prefix_affinity", "round_robin",
                                  "session_affinity"])
def test_empty_fleet_gives_no_engine(name: str) -> None:
    decision = make_policy(name)(RouteSnapshot(()), REQ_320)
    assert decision.ranked == () and "no live engine" in decision.reason


@pytest.mark.parametrize("name", ["approx_prefix", "least_loaded", "prefix_affinity", "round_robin",
                                  "session_affinity"])
def test_every_policy_ranks_every_engine_and_pressure_last(name: str) -> None:
    snap = RouteSnapshot((engine("a", pressure=True), engine("b"), engine("c")))
    decision = make_policy(name)(snap, REQ_320)
    assert sorted(decision.ranked) == ["a", "b", "c"]
    assert decision.ranked[-1] == "a"


def test_round_robin_cycles_in_id_order() -> None:
    policy = make_policy("round_robin")
    snap = RouteSnapshot((engine("b"), engine("a"), engine("c")))
    assert [policy(snap, REQ_320).ranked[0] for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_ranks_by_load_then_kv_usage_in_steps() -> None:
    policy = make_policy("least_loaded")
    snap = RouteSnapshot((engine("b", 1), engine("a", 1), engine("c", 0, 2)))
    assert all(policy(snap, REQ_320).ranked[2] == "c" for _ in range(10))
    snap = RouteSnapshot((engine("b", 1, kv=0.1), engine("a", 1, kv=0.5)))
    assert all(policy(snap, REQ_320).ranked == ("b", "a") for _ in range(10))


@pytest.mark.parametrize("name", ["least_loaded", "session_affinity"])
def test_equally_loaded_engines_share_the_decisions_between_heartbeats(name: str) -> None:
    """Stale loads must not herd: 1,000 idle engines whose KV usage differs only in the fourth digit, 300
    decisions before any heartbeat (and none counted in flight) spread over many engines, not one."""
    policy = make_policy(name)
    snap = RouteSnapshot(tuple(engine(f"e{i:04d}", kv=0.0001 * (i % 7)) for i in range(1000)))
    firsts = [policy(snap, RouteRequest("t", "m", 10)).ranked[0] for _ in range(300)]
    assert len(set(firsts)) > 200
    assert max(firsts.count(e) for e in set(firsts)) <= 5


def test_least_loaded_counts_this_gateways_in_flight_requests() -> None:
    policy = make_policy("least_loaded")
    snap = RouteSnapshot((engine("a"), engine("b")), local_in_flight={"a": 3})
    assert policy(snap, REQ_320).ranked[0] == "b"


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
    decision = policy(snap, REQ_320)
    assert decision.ranked[0] == "a"
    assert decision.expected_cached_tokens == 8 * 32
    assert "cached_tokens=256" in decision.reason


def test_prefix_affinity_without_hits_goes_to_the_prefixs_home() -> None:
    policy = make_policy("prefix_affinity")
    home, other = policies.prefix_homes(("a", "b"), REQ_320.block_hashes[0])
    # Loads 2 and 1: mean 1.5, bound 2.875: both under it. A new prefix takes the less loaded of its homes,
    # and its next request follows it there until the index shows it held; once held and evicted since, the
    # home takes its miss even if busier.
    snap = RouteSnapshot((engine(home, 2), engine(other, 1)))
    first = policy(snap, REQ_320)
    assert first.ranked == (other, home) and "miss: new prefix" in first.reason
    pending = policy(snap, REQ_320)
    assert pending.ranked == (other, home) and "pending where it was sent" in pending.reason
    assert policy(RouteSnapshot(snap.engines, {other: 8}), REQ_320).ranked[0] == other
    decision = policy(snap, REQ_320)
    assert decision.ranked == (home, other) and "miss: home" in decision.reason


def test_prefix_affinity_pressure_flag_beats_cache_hits() -> None:
    policy = make_policy("prefix_affinity")
    snap = RouteSnapshot((engine("a", pressure=True), engine("b")), cached_prefix_blocks={"a": 10})
    assert policy(snap, REQ_320).ranked == ("b", "a")


def test_approx_prefix_forgets_dead_engines() -> None:
    policy = make_policy("approx_prefix")
    req = RouteRequest("t", "m", 100, prompt_prefix="x" * 600)
    first = policy(RouteSnapshot((engine("a"), engine("b"))), req).ranked[0]
    survivor = "b" if first == "a" else "a"
    assert policy(RouteSnapshot((engine(survivor),)), req).ranked == (survivor,)


def _reference_prefix_affinity(snap: RouteSnapshot, request: RouteRequest,
                               placed: dict[int, str]) -> list[tuple[str, tuple[object, ...]]]:
    """prefix_affinity's ranking of the whole fleet, the plain way (sort every engine by its full key; then a
    prefix nobody holds and not in ``placed``, or one whose holders are all closed, moves the open engine of
    the first MAX_RANKED_ENGINES with the shortest prefill backlog, then the fewest requests, to the front, and
    one ``placed`` on an engine not yet seen holding it (not ``SETTLED``) moves that engine to the front while
    it is open)."""
    engines = snap.engines
    loads = [max(e.load, snap.local_in_flight.get(e.engine_id, 0)) for e in engines]
    bound = policies.BOUND_FACTOR * sum(loads) / len(loads) + 1
    reusable = max(request.num_prompt_tokens - 1, 0)
    cached = [min(snap.cached_prefix_blocks.get(e.engine_id, 0) * e.block_size, reusable // e.block_size * e.block_size)
              for e in engines]
    homes = policies.prefix_homes(tuple(e.engine_id for e in engines), request.block_hashes[0])
    home_rank = {engine_id: rank for rank, engine_id in enumerate(homes)}
    by_id = {e.engine_id: i for i, e in enumerate(engines)}
    open_homes = [e for e in homes if not engines[by_id[e]].under_pressure and loads[by_id[e]] < bound][:2]
    if len(open_homes) == 2 and loads[by_id[open_homes[1]]] == 0 < loads[by_id[open_homes[0]]]:
        first, second = open_homes
        home_rank[first], home_rank[second] = home_rank[second], home_rank[first]

    def score(i: int) -> tuple[object, ...]:
        over = loads[i] >= bound
        credit = 0 if over else cached[i]
        price = (policies.TOKENS_PER_RUNNING_REQUEST * loads[i]
                 + policies.TOKENS_PER_WAITING_REQUEST * engines[i].num_waiting) if credit else 0
        return engines[i].under_pressure, over, -credit, price

    order = sorted(range(len(engines)), key=lambda i: (*score(i), home_rank[engines[i].engine_id]))

    def place_by_backlog() -> None:
        choices = [i for i in order[:policies.MAX_RANKED_ENGINES] if not engines[i].under_pressure and loads[i] < bound]
        if len(choices) > 1:
            backlog = {i: max(engines[i].pending_prefill_tokens,
                              snap.local_pending_prefill_tokens.get(engines[i].engine_id, 0)) for i in choices}
            best = min(choices, key=lambda i: (backlog[i] // policies.PENDING_PREFILL_STEP,
                                               loads[i] + engines[i].num_waiting))
            order.remove(best)
            order.insert(0, best)

    key = request.block_hashes[0]
    state = placed.get(key)
    if any(snap.cached_prefix_blocks.get(e.engine_id, 0) > 0 for e in engines):
        placed[key] = policies.SETTLED
        if not score(order[0])[2] and any(cached):  # every holder closed: placed as a new prefix is
            place_by_backlog()
    elif state is None:
        place_by_backlog()
        placed[key] = engines[order[0]].engine_id
    elif state != policies.SETTLED:
        i = by_id.get(state)
        if i is not None and not engines[i].under_pressure and loads[i] < bound:
            order.remove(i)
            order.insert(0, i)
        else:
            placed[key] = engines[order[0]].engine_id
    return [(engines[i].engine_id, score(i)) for i in order]


def test_prefix_affinity_ranks_a_large_fleets_first_engines_exactly_as_a_full_sort() -> None:
    """Past MAX_RANKED_ENGINES the policy scores only the engines whose score differs from the rest (prefix
    holders, this gateway's in-flight engines) and the prefix's homes up to MAX_RANKED_ENGINES open ones:
    its ranking must equal the first MAX_RANKED_ENGINES of a full sort by (score, home order)."""
    rng = random.Random(5)
    policy = make_policy("prefix_affinity")
    for trial in range(400):
        # Mostly a few engines under pressure (the fast path: MAX_RANKED_ENGINES open homes met); in every
        # fourth fleet most are (fewer open engines than that: the full sort).
        pressured = 0.6 if trial % 4 == 0 else 0.05
        size = rng.choice((17, 40, 120))
        fleet = tuple(replace(engine(f"e{i:03d}", running=rng.randrange(4), waiting=rng.choice((0, 0, 0, 1)),
                                     pressure=rng.random() < pressured, block_size=16),
                              pending_prefill_tokens=rng.choice((0, 0, 0, 700, 1500, 3000)))
                      for i in range(size))
        ids = [e.engine_id for e in fleet]
        keys = [rng.getrandbits(64) for _ in range(2)]
        placed: dict[int, str] = {}  # the prefixes the policy has routed (new ones are placed by load)
        # Several requests per fleet, on two prefixes: the second request of a prefix reuses the homes the
        # policy made for the first (``_Fleet.homes``) under other cached prefixes and in-flight counts.
        for _ in range(4):
            cached = {e: rng.randrange(1, 64) for e in rng.sample(ids, rng.choice((0, 1, 1, 2, 3)))}
            in_flight = {e: rng.randrange(1, 8) for e in rng.sample(ids, rng.choice((0, 0, 1, 3)))}
            request = RouteRequest("t", "m", 16 * 64 + 1, (rng.choice(keys), trial))
            pending = {e: rng.choice((0, 900, 2500)) for e in in_flight}
            snap = RouteSnapshot(fleet, cached, in_flight, pending)
            got = policy(snap, request).ranked
            want = _reference_prefix_affinity(snap, request, placed)
            assert len(got) == policies.MAX_RANKED_ENGINES
            assert list(got) == [e for e, _ in want[:policies.MAX_RANKED_ENGINES]]


def _naive_walk(ring: policies._Ring, key: int, num_engines: int) -> tuple[int, ...]:
    """The first ``num_engines`` distinct owners clockwise from ``key``'s point, one point at a time."""
    return _naive_walk_from(ring, ring.start(key), num_engines)


def _naive_walk_from(ring: policies._Ring, start: int, num_engines: int) -> tuple[int, ...]:
    seen: dict[int, None] = {}
    for step in range(len(ring.owners)):
        seen.setdefault(ring.owners[(start + step) % len(ring.owners)])
        if len(seen) == num_engines:
            break
    return tuple(seen)


@pytest.mark.parametrize("num_engines", [1, 2, 5, 31, 32, 33, 64, 1000])
def test_the_walks_made_with_the_ring_are_the_plain_walk_from_every_position(num_engines: int) -> None:
    """The short walks are made backwards from each position's successor's (``_Ring._short_walks``); each
    equals the point-by-point walk from its position, wrap-around included, and a decision's walk (up to
    ``short_depth`` engines) is read from them without making a walk."""
    ring = policies._Ring(tuple(f"short-e{i}" for i in range(num_engines)))
    assert ring.short_depth == min(num_engines, 2 * policies.MAX_RANKED_ENGINES)
    for position in range(len(ring.owners)):
        assert ring.short_walks[position] == _naive_walk_from(ring, position, ring.short_depth), position
    rng = random.Random(num_engines)
    for _ in range(100):
        key = rng.getrandbits(64)
        assert ring.walk(key, ring.short_depth) == ring.short_walks[ring.start(key)]
    assert not ring._walks  # nothing made on the way


@pytest.mark.parametrize("num_engines", [1, 3, 17, 64, 300])
def test_ring_walks_and_offsets_are_the_plain_walk(num_engines: int) -> None:
    """The ring's stretch-doubling walk (and its memo, which may answer with a longer walk than asked) starts
    as walking point by point does, for short and whole walks; ordering engines by ``offset`` is ordering
    them by their place in the whole walk."""
    rng = random.Random(num_engines)
    ring = policies._Ring(tuple(f"ring-e{i}" for i in range(num_engines)))
    for _ in range(200):
        key = rng.getrandbits(64)
        for length in {1, min(num_engines, 32), num_engines}:
            walk = ring.walk(key, length)
            assert len(walk) >= length and walk[:length] == _naive_walk(ring, key, length)
        whole = _naive_walk(ring, key, num_engines)
        assert sorted(range(num_engines), key=lambda i: ring.offset(key, i)) == list(whole)
