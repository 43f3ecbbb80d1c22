"""prefix_affinity once the router has learned how long a prefill takes (routing/prefill_clock.py): a hit leaves
its holder only where its first token comes sooner elsewhere by a margin, counting what each engine would
reuse, and a new prefix goes to the open home with the shortest prefill wait in time, not in tokens."""

from __future__ import annotations

from dataclasses import replace

from tessera.routing import policies
from tessera.routing.policies import make_policy, prefix_homes
from tessera.routing.prefill_clock import PrefillFit
from tessera.routing.snapshot import EngineView, RouteRequest, RouteSnapshot

IDS = ("a", "b", "c", "d")
KEY = 24680
HOMES = prefix_homes(IDS, KEY)
# 2 ms + 0.1 ms a token: the 1,032-token prompt below prefills in ~105 ms; the margin is 25.6 ms.
FIT = PrefillFit(0.002, 1e-4)
HELD = {HOMES[0]: 31}  # 992 tokens of the prompt cached at its first home


def engine(engine_id: str, running: int = 1, pending_tokens: int = 0) -> EngineView:
    return EngineView(engine_id, f"http://{engine_id}", running, 0, 0.0, 1000, 32, False, pending_tokens)


def request() -> RouteRequest:
    return RouteRequest("t", "m", 32 * 31 + 40, (KEY, *range(1, 31)))


def fleet(running: dict[str, int] | None = None) -> tuple[EngineView, ...]:
    return tuple(engine(e, (running or {}).get(e, 1)) for e in IDS)


def test_a_hit_stays_where_its_holders_prefill_is_nearly_done() -> None:
    # 50 ms of the holder's queue left, against ~100 ms to prefill the prompt anywhere else.
    waits = {HOMES[0]: 0.050}
    decision = make_policy("prefix_affinity")(RouteSnapshot(fleet(), HELD, prefill_wait_s=waits, prefill_fit=FIT),
                                              request())
    assert decision.ranked[0] == HOMES[0] and decision.expected_cached_tokens == 992


def test_a_hit_moves_where_its_first_token_comes_sooner_when_a_long_prefill_just_began_at_its_holder() -> None:
    waits = {HOMES[0]: 0.400, HOMES[1]: 0.300, HOMES[3]: 0.010}
    snap = RouteSnapshot(fleet(), HELD, prefill_wait_s=waits, prefill_fit=FIT)
    decision = make_policy("prefix_affinity")(snap, request())
    # ~105 ms of prefill on the idle homes[2], against 400 ms behind the holder's queue.
    assert decision.ranked[:2] == (HOMES[2], HOMES[0]) and decision.expected_cached_tokens == 0
    assert "sooner elsewhere" in decision.reason and "400.0 ms" in decision.reason
    # Without a fit (too few samples yet) the holder keeps its hit, whatever the waits.
    assert make_policy("prefix_affinity")(snap._replace(prefill_fit=None), request()).ranked[0] == HOMES[0]
    # Within the margin it stays: ~105 ms on an idle engine against ~126 ms behind the holder's 120 ms queue is
    # 21 ms sooner, not the 25.6 ms a move must save.
    close = snap._replace(prefill_wait_s={HOMES[0]: 0.120})
    assert make_policy("prefix_affinity")(close, request()).ranked[0] == HOMES[0]


def test_a_hit_moves_only_to_an_open_engine_and_counts_what_each_would_reuse() -> None:
    waits = {HOMES[0]: 0.400, HOMES[1]: 0.300, HOMES[3]: 0.010}
    # homes[2] is over the load bound (loads 1, 1, 5, 1: bound 5): the next soonest, homes[3].
    busy = fleet({HOMES[2]: 5})
    decision = make_policy("prefix_affinity")(RouteSnapshot(busy, HELD, prefill_wait_s=waits, prefill_fit=FIT),
                                              request())
    assert decision.ranked[0] == HOMES[3]
    # homes[1] holds 25 of the blocks behind a 50 ms wait: 50 ms + 19 ms of prefill beats ~100 ms on an idle one.
    partial = {**HELD, HOMES[1]: 25}
    waits = {HOMES[0]: 0.400, HOMES[1]: 0.050}
    decision = make_policy("prefix_affinity")(RouteSnapshot(fleet(), partial, prefill_wait_s=waits, prefill_fit=FIT),
                                              request())
    assert decision.ranked[0] == HOMES[1] and decision.expected_cached_tokens == 800


def test_a_new_prefix_goes_to_the_home_with_the_shortest_wait_in_time_once_there_is_a_fit() -> None:
    """homes[1] holds 3,000 tokens nearly prefilled (10 ms left), the others a few hundred just begun: in tokens
    homes[1] looks busiest, in time it is the soonest."""
    step = policies.PENDING_PREFILL_STEP
    pending = {HOMES[1]: 3 * step}
    views = tuple(replace(engine(e), pending_prefill_tokens=pending.get(e, 0)) for e in IDS)
    waits = {HOMES[0]: 0.200, HOMES[1]: 0.010, HOMES[2]: 0.300, HOMES[3]: 0.150}
    by_tokens = make_policy("prefix_affinity")(RouteSnapshot(views, prefill_wait_s=waits), request())
    assert by_tokens.ranked[0] == HOMES[0] and "miss: new prefix" in by_tokens.reason
    by_time = make_policy("prefix_affinity")(RouteSnapshot(views, prefill_wait_s=waits, prefill_fit=FIT), request())
    assert by_time.ranked[0] == HOMES[1] and "miss: new prefix" in by_time.reason
    # Waits within one step (WAIT_STEP_TOKENS' prefill time, 12.8 ms) of each other: the request counts decide.
    near = {e: 0.001 * i for i, e in enumerate(HOMES)}
    views = tuple(engine(e, running=2 if e == HOMES[0] else 1) for e in IDS)
    decision = make_policy("prefix_affinity")(RouteSnapshot(views, prefill_wait_s=near, prefill_fit=FIT), request())
    assert decision.ranked[0] == HOMES[1]


def _plain_sooner_elsewhere(ranked: list[int], closed: frozenset[int], loads: dict[int, int],
                            fleet: policies._Fleet, bound: float, cached: dict[int, int], waits: dict[str, float],
                            fit: PrefillFit) -> int | None:
    """The rule as docs/routing.md states it, every open engine's cost computed."""
    holder_wait = waits.get(fleet.ids[ranked[0]], 0.0)
    if holder_wait <= 0:
        return None
    best, best_cost = None, holder_wait - fit.s_per_token * (cached[ranked[0]] + policies.MOVE_MARGIN_TOKENS)
    for i in ranked[1:]:
        if i in closed or loads.get(i, fleet.loads[i]) >= bound:
            continue
        cost = waits.get(fleet.ids[i], 0.0) - fit.s_per_token * cached.get(i, 0)
        if cost < best_cost:
            best, best_cost = i, cost
    return best


def _plain_least_backlogged(ranked: list[int], closed: frozenset[int], loads: dict[int, int],
                            fleet: policies._Fleet, bound: float, local_pending: dict[str, int],
                            waits: dict[str, float], fit: PrefillFit | None) -> int | None:
    """The open engine of the ranking with the least (backlog in steps, requests), the first of equals; None with
    fewer than two open. The backlog: the wait with a fit, else the larger of the heartbeat's and the pod's
    pending tokens."""
    def backlog(i: int) -> int:
        if fit is not None:
            return int(waits.get(fleet.ids[i], 0.0) / (fit.s_per_token * policies.WAIT_STEP_TOKENS))
        pending = max(fleet.engines[i].pending_prefill_tokens, local_pending.get(fleet.ids[i], 0))
        return pending // policies.PENDING_PREFILL_STEP

    open_ones = [i for i in ranked if i not in closed and loads.get(i, fleet.loads[i]) < bound]
    if len(open_ones) < 2:
        return None
    return min(open_ones, key=lambda i: (backlog(i), loads.get(i, fleet.loads[i]) + fleet.engines[i].num_waiting))


def test_the_scans_that_skip_reading_waits_choose_as_the_plain_scans_do() -> None:
    # The scans pass over engines whose wait cannot change the answer (a cost's floor, a request count that
    # cannot win); on random fleets they answer exactly as the scans that read every wait.
    import random

    rng = random.Random(7)
    for _ in range(3000):
        ids = tuple(f"e{n}" for n in range(rng.randrange(2, 20)))
        views = tuple(EngineView(e, f"http://{e}", rng.randrange(4), rng.randrange(3), 0.0, 1000, 32, False,
                                 rng.choice((0, 0, 500, 1500, 4000))) for e in ids)
        fleet = policies._Fleet.of(views)
        ranked = rng.sample(range(len(ids)), rng.randrange(1, len(ids) + 1))
        closed = frozenset(i for i in range(len(ids)) if rng.random() < 0.15)
        loads = {i: rng.randrange(8) for i in range(len(ids)) if rng.random() < 0.3}
        bound = rng.choice((3.0, 5.5, 100.0))
        waits = {e: rng.choice((0.0, 0.0, 0.01, 0.05, 0.2, 0.4, rng.random())) for e in ids if rng.random() < 0.6}
        fit = PrefillFit(0.002, rng.choice((1e-4, 1e-3)))
        local_pending = {e: rng.choice((300, 1200, 5000)) for e in ids if rng.random() < 0.3}
        for maybe_fit in (fit, None):  # waits in time once there is a fit, tokens before
            assert policies._least_backlogged(ranked, closed, loads, fleet, bound, local_pending, waits, maybe_fit) \
                == _plain_least_backlogged(ranked, closed, loads, fleet, bound, local_pending, waits, maybe_fit)
        cached = {i: rng.choice((32, 320, 992)) for i in ranked if rng.random() < 0.3}
        cached[ranked[0]] = rng.choice((32, 320, 992))
        assert policies._sooner_elsewhere(ranked, closed, loads, fleet, bound, cached, waits, fit) == \
            _plain_sooner_elsewhere(ranked, closed, loads, fleet, bound, cached, waits, fit)
