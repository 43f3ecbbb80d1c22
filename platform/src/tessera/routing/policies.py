"""Routing policies: pure functions over a ``RouteSnapshot``, registered by name.

Every policy returns *all* live engines ranked best-first (the gateway falls back down the list when a
replica refuses) and a short reason that ends up in ``x-tessera-route-reason`` and the trace. Engines the
KV-eviction controller flags as under pressure always rank after the others.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import weakref
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from tessera.routing.affinity_native import Constants, native_fleet, native_ring, rank_natively
from tessera.routing.hashing import stable_hash64
from tessera.routing.prefill_clock import PrefillFit
from tessera.routing.snapshot import EngineView, RouteDecision, RouteRequest, RouteSnapshot

PolicyFn = Callable[[RouteSnapshot, RouteRequest], RouteDecision]
_REGISTRY: dict[str, Callable[[], PolicyFn]] = {}


def register(name: str) -> Callable[[Callable[[], PolicyFn]], Callable[[], PolicyFn]]:
    def wrap(factory: Callable[[], PolicyFn]) -> Callable[[], PolicyFn]:
        _REGISTRY[name] = factory
        return factory

    return wrap


# A policy's state that depends only on a registry read's engines (prefix_affinity's ``_Fleet``), built for
# each model's engines as the router reads the registry (``prepare_policy``), so the first request after each
# read does not build it: at 1,000 engines that cost one request's route ~1.5-2 ms, once a second.
Preparer = Callable[[list[tuple[EngineView, ...]]], None]
_PREPARERS: weakref.WeakKeyDictionary[PolicyFn, Preparer] = weakref.WeakKeyDictionary()


def prepare_policy(policy: PolicyFn, fleets: list[tuple[EngineView, ...]]) -> None:
    """Builds ``policy``'s per-read state for a registry read's engines (``fleets``: each model's views), in
    place of what an earlier read left; a no-op for a policy that keeps none."""
    prepare = _PREPARERS.get(policy)
    if prepare is not None:
        prepare(fleets)


def make_policy(name: str) -> PolicyFn:
    """A fresh policy instance (stateful policies keep their state per instance, i.e. per gateway)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown routing policy {name!r}; valid: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]()


def policy_names() -> list[str]:
    return sorted(_REGISTRY)


def _load(engine: EngineView, snapshot: RouteSnapshot) -> int:
    # Heartbeats lag by up to a second; this gateway's own in-flight count is always current.
    return max(engine.load, snapshot.local_in_flight.get(engine.engine_id, 0))


# KV cache usage ranks equally loaded engines in steps of this share, not by its exact value (see _by_load).
KV_USAGE_STEP = 0.1


# NOTE: equally loaded engines are told apart by a fresh random draw per engine per decision. Load signals lag
# (heartbeats every second; each gateway worker sees only its own in-flight requests), and a fixed tie-break —
# an engine's id, or its exact KV usage, which differs in the fourth digit — sent every decision between two
# heartbeats, from every worker, to the same engine: at 1,000 simulated engines least_loaded piled 228 requests on
# one replica while most sat idle (docs/routing.md). Each policy instance draws from its own ``random.Random``
# seeded from the OS, so gateway workers spread differently. (``hash((salt, id))`` did this before and was biased:
# under some string-hash seeds one of two tied engines won 95% of the salts.)


def _by_load(snapshot: RouteSnapshot, draw: Callable[[], float]) -> list[EngineView]:
    return sorted(snapshot.engines, key=lambda e: (e.under_pressure, _load(e, snapshot),
                                                   int(e.kv_cache_usage / KV_USAGE_STEP), draw()))


def _pressure_last(order: list[EngineView]) -> tuple[str, ...]:
    return tuple(e.engine_id for e in sorted(order, key=lambda e: e.under_pressure))


def _empty(snapshot: RouteSnapshot) -> RouteDecision | None:
    return RouteDecision((), "no live engine") if not snapshot.engines else None


@register("round_robin")
def _round_robin() -> PolicyFn:
    counter = [0]

    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        engines = sorted(snapshot.engines, key=lambda e: e.engine_id)
        start = counter[0] % len(engines)
        counter[0] += 1
        order = engines[start:] + engines[:start]
        return RouteDecision(_pressure_last(order), "round_robin")

    return policy


@register("least_loaded")
def _least_loaded() -> PolicyFn:
    draw = random.Random().random

    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        order = _by_load(snapshot, draw)
        return RouteDecision(tuple(e.engine_id for e in order), f"least_loaded load={_load(order[0], snapshot)}")

    return policy


def _rendezvous(key: str, engine_id: str) -> int:
    return stable_hash64(f"{key}|{engine_id}")


@register("session_affinity")
def _session_affinity() -> PolicyFn:
    draw = random.Random().random

    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        if request.session_id is None:
            order = _by_load(snapshot, draw)
            return RouteDecision(tuple(e.engine_id for e in order), "session_affinity no session: least_loaded")
        # Rendezvous hashing: a session stays put when other engines come and go.
        order = sorted(snapshot.engines, key=lambda e: -_rendezvous(request.session_id or "", e.engine_id))
        return RouteDecision(_pressure_last(order), "session_affinity")

    return policy


APPROX_CHUNK_CHARS = 128
# Chunk keys one approx_prefix instance remembers (least recently used forgotten first): bounds its memory.
APPROX_MAX_CHUNKS = 200_000


@dataclass
class _ApproxState:
    # chained chunk digest -> engines this policy instance sent that prefix to, in LRU order.
    senders: OrderedDict[bytes, set[str]] = field(default_factory=OrderedDict)
    # Breaks ties at random like production-stack (seeded: a run is reproducible).
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def remember(self, chain: list[bytes], engine_id: str) -> None:
        for key in chain:
            self.senders.setdefault(key, set()).add(engine_id)
            self.senders.move_to_end(key)
        while len(self.senders) > APPROX_MAX_CHUNKS:
            self.senders.popitem(last=False)


def _char_chunks(model: str, text: str, cache_salt: str | None) -> list[bytes]:
    """Parent-chained digests of the text's whole 128-character chunks (a trie path, flattened), keyed by the
    model and the tenant's cache salt: a tenant whose prefix cache is isolated shares no chunk with another,
    as it shares no KV block (hashing.py)."""
    digest = hashlib.blake2b(model.encode() + b"\0" + (cache_salt or "").encode(), digest_size=16)
    chain: list[bytes] = []
    for start in range(0, len(text) - len(text) % APPROX_CHUNK_CHARS, APPROX_CHUNK_CHARS):
        digest.update(text[start:start + APPROX_CHUNK_CHARS].encode())
        chain.append(digest.copy().digest())
    return chain


@register("approx_prefix")
def _approx_prefix() -> PolicyFn:
    """Baseline like production-stack's prefix-aware router (``HashTrie``): remembers which engines it
    *sent* each character-prefix chunk to, narrows to the engines sharing the longest remembered prefix,
    and never learns that an engine evicted it. Its memory is per gateway process, as in production-stack.
    Among the matching engines (all engines on a miss) it takes the least loaded, ties at random
    (production-stack picks at random without looking at load).

    Chunks are keyed with the tenant's cache salt (``RouteRequest.cache_salt``), and the reason is the same
    on a hit and a miss: it travels to the client in ``x-tessera-route-reason``, and a count of matched
    chunks there told a tenant whether anyone had sent a prompt beginning with a guess (issue #15)."""
    state = _ApproxState()

    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        chain = _char_chunks(request.model, request.prompt_prefix, request.cache_salt)
        candidates = {e.engine_id for e in snapshot.engines}
        for key in chain:
            holders = state.senders.get(key, set()) & candidates
            if not holders:
                break
            candidates = holders
        shuffled = list(snapshot.engines)
        state.rng.shuffle(shuffled)
        order = sorted(shuffled, key=lambda e: (e.engine_id not in candidates, _load(e, snapshot)))
        ranked = _pressure_last(order)
        state.remember(chain, ranked[0])
        return RouteDecision(ranked, "approx_prefix")

    return policy


# Bounded load (consistent hashing with bounded loads, Mirrokni et al.): an engine may take an affinity
# request only while its load stays below BOUND_FACTOR x mean load (+1 so an idle fleet still has room).
# Why 2 and not the classic 1.25 (docs/routing.md "The load bound"): a spill is a whole prefill elsewhere and
# a copy there that evicts another prefix, so a tight bound feeds the overload it guards against. Overloaded
# with tight caches (bench-routing's virtual-time sweep) 1.25 kept 81.8 % of the ideal hit rate at p99 6.1 s
# and 2 kept 90.9 % at 4.2 s; 64 simulated H100s at 40 requests/s each: 95-96 % at p99 331-340 ms against
# 97.4-97.6 % at 280-365 (3: 98.4 %, p99 317). A hot prefix still spills before its engine carries twice the
# mean load.
BOUND_FACTOR = 2.0


def _load_bound(sum_loads: int, num_engines: int) -> float:
    """The load an engine must stay under to take an affinity request: BOUND_FACTOR x mean load, + 1."""
    return BOUND_FACTOR * sum_loads / num_engines + 1


# Load priced in cached tokens, used only between engines that would reuse the same number of cached
# tokens (two holders of the whole prefix): the less busy one. A running request costs little (continuous
# batching shares each step), a waiting one delays the first token until a slot frees.
TOKENS_PER_RUNNING_REQUEST = 64
TOKENS_PER_WAITING_REQUEST = 512
# The consistent-hash ring every prefix's homes are read from: points per engine (fewer in a large fleet,
# so the ring stays at most RING_MAX_POINTS long). A ring is built when the set of engines changes, on the
# first request after that registry read: a few milliseconds at most (an engine's points are hashed once
# per process).
RING_POINTS_PER_ENGINE = 160
RING_MAX_POINTS = 4096
_GOLDEN_64 = 0x9E3779B97F4A7C15
_MASK_64 = (1 << 64) - 1


@lru_cache(maxsize=4096)
def _engine_salt(engine_id: str) -> int:
    return stable_hash64(engine_id)


@lru_cache(maxsize=65536)
def _ring_points(engine_id: str, num_points: int) -> tuple[int, ...]:
    """An engine's points on the ring (64-bit, as block hashes are): the same in every gateway process."""
    return tuple(stable_hash64(f"{engine_id}#{k}") for k in range(num_points))


class _Ring:
    """A fleet's consistent-hash ring: points in ascending order, the engine (index into the fleet) owning
    each, and, per point, the distinct engines met walking clockwise from it: the first ``short_depth``
    (what a decision reads) made with the ring, longer walks on first use."""

    __slots__ = ("_walks", "native", "owners", "points", "positions", "short_depth", "short_walks")

    def __init__(self, engine_ids: tuple[str, ...]) -> None:
        per_engine = max(1, min(RING_POINTS_PER_ENGINE, RING_MAX_POINTS // max(len(engine_ids), 1)))
        points: list[int] = []
        for engine_id in engine_ids:
            points.extend(_ring_points(engine_id, per_engine))
        order = sorted(range(len(points)), key=points.__getitem__)
        self.points = [points[k] for k in order]
        self.owners = [k // per_engine for k in order]
        # Each engine's places on the ring, ascending (for ``offset``).
        self.positions: list[list[int]] = [[] for _ in engine_ids]
        for position, owner in enumerate(self.owners):
            self.positions[owner].append(position)
        self._walks: dict[int, tuple[int, ...]] = {}
        self.short_depth = min(len(engine_ids), 2 * MAX_RANKED_ENGINES)
        self.short_walks = self._short_walks()
        # The same ring as the C step's arrays (affinity_native.py), or None where it is not built.
        self.native = native_ring(self.points, self.short_walks, self.positions)

    def _short_walks(self) -> list[tuple[int, ...]]:
        """Every position's walk to ``short_depth`` engines. Made on first use, a walk cost a decision 2-5 us
        (a cold stretch of the ring, scanned), and a gateway meets each of the ring's ~4,000 positions for the
        first time over its first tens of thousands of requests, and again after each fleet change. Made
        here, in one pass backwards round the ring (a position's walk is its own engine, then its
        successor's walk without that engine), it costs ~4 ms once per fleet change, and a decision reads
        a list."""
        owners, depth = self.owners, self.short_depth
        walks: list[tuple[int, ...]] = [()] * len(owners)
        after = self._long_walk(0, depth)  # position 0's walk: the last position's successor's
        for position in range(len(owners) - 1, -1, -1):
            owner = owners[position]
            if after[0] != owner:
                if owner in after:
                    k = after.index(owner)
                    after = (owner, *after[:k], *after[k + 1:])
                else:
                    after = (owner, *after[:depth - 1])
            walks[position] = after
        self._walks.clear()
        return walks

    def start(self, key: int) -> int:
        """The ring position a walk from ``key`` starts at."""
        start = bisect_left(self.points, _ring_key(key))
        return 0 if start == len(self.points) else start

    def offset(self, key: int, engine: int) -> int:
        """How far clockwise from ``key``'s start the engine's first point lies. Engines ordered by it are in
        ``walk`` order (a walk lists engines as it first meets one of their points), at O(log points) an
        engine where placing one engine by a walk costs a walk of the fleet."""
        start, places = self.start(key), self.positions[engine]
        j = bisect_left(places, start)
        return places[j] - start if j < len(places) else places[0] + len(self.points) - start

    def walk(self, key: int, num_engines: int) -> tuple[int, ...]:
        """The first ``num_engines`` distinct engines clockwise from ``key``'s position."""
        start = self.start(key)
        if num_engines <= self.short_depth:
            return self.short_walks[start][:num_engines]
        return self._long_walk(start, num_engines)

    def _long_walk(self, start: int, num_engines: int) -> tuple[int, ...]:
        """A walk longer than the short ones (many engines over the load bound), kept once made."""
        walk = self._walks.get(start)
        if walk is None or len(walk) < num_engines:
            # The distinct owners of a stretch of the ring from ``start``, the stretch doubled until it holds
            # enough: dict.fromkeys keeps first appearances in order, in C (a Python step per point cost
            # ~10 us for a cold 32-engine walk).
            owners, num_points = self.owners, len(self.owners)
            span = min(num_points, 2 * num_engines)
            while True:
                end = start + span
                stretch = owners[start:end] if end <= num_points else owners[start:] + owners[:end - num_points]
                seen = dict.fromkeys(stretch)
                if len(seen) >= num_engines or span == num_points:
                    break
                span = min(num_points, 2 * span)
            walk = self._walks[start] = tuple(itertools.islice(seen, num_engines))
        return walk


@lru_cache(maxsize=16)
def _ring(engine_ids: tuple[str, ...]) -> _Ring:
    return _Ring(engine_ids)


def _ring_key(key: int) -> int:
    # Block hashes are uniform already; the multiply (Fibonacci hashing) spreads keys that are not.
    return (key * _GOLDEN_64) & _MASK_64


def prefix_homes(engine_ids: tuple[str, ...], key: int) -> list[str]:
    """Every engine, in the order a prefix whose first block hash is ``key`` tries them as its home."""
    return [engine_ids[i] for i in _ring(engine_ids).walk(key, len(engine_ids))]


# A prefix nobody holds and this policy instance has never routed goes to the open engine of its ranking (its
# first MAX_RANKED_ENGINES open homes, in ring order) with the shortest prefill backlog, then the fewest
# requests (waiting ones counted twice: they delay a first token, running ones share steps), ties in ring
# order; so does a request whose holders are all over the bound (a spill prefills its whole prompt too). Why
# (issue #17, docs/routing.md "Where prefix_affinity's p99 goes" and "Cold prompts placed fleet-wide"): at 64
# overloaded engines the slowest 1 % were long unique prompts sent to a first home that also served a hot
# prefix at twice the mean load, and the hits queued behind their prefill; at 16, with the choice among the
# first four homes, all four were prefilling in one placement of five and the prompt queued behind another.
# Until an engine is seen holding it, the prefix's next requests follow it to the engine it was sent to (its
# blocks are on their way: a prefill, then the KV events' lag; sending them to the first home instead made a
# second copy there, which under overload is a second prefill and an eviction). Once seen held, an evicted
# prefix goes back to its first home, which every gateway worker computes alike: placing evicted prefixes by
# load (or by each worker's own memory) moves them among caches, the failure with scarce caches.
# Rule 6 compares the homes' prefill backlogs (prompt tokens waiting for their first token) in steps of this
# many tokens, so a few tokens' difference leaves the choice to the request counts. The backlog, not the count,
# is what a long cold prompt waits behind: one engine holding a 4,000-token prefill and another with three
# requests in decode both read "load 3" in requests.
PENDING_PREFILL_STEP = 1024
# Once the router has a prefill-time fit (routing/prefill_clock.py), rule 6 compares the homes' prefill *waits*
# instead, in steps of the time this many tokens take to prefill: a backlog's tokens say how much is queued, not
# when it ends, and a 4,000-token prompt about done and one just begun read alike (docs/routing.md "The wait
# priced in time, landed"). At 16 overloaded engines, with the hit rule below, TTFT p99 went from 162 to 150
# simulated ms in the scratch runs that led to it (docs/routing.md "A lead: the wait priced in time").
WAIT_STEP_TOKENS = 128
# And a hit may leave its holder: for the open engine of its ranking where its first token comes soonest (the
# wait there plus the prefill of what is not cached there), when that is sooner than behind the holder's queue
# by more than the time this many tokens take to prefill. The margin keeps a hit at its holder for a small
# gain: each move prefills the prefix a second time and, with scarce caches, evicts another.
MOVE_MARGIN_TOKENS = 256
# Fleets (one a model) a prefix_affinity instance keeps between registry reads; past it, it starts afresh.
MAX_CACHED_FLEETS = 16
# How many prefixes' keys a policy instance remembers as routed (two generations of half each: ~15-20 MB).
SEEN_PREFIXES = 200_000


class _Placements:
    """The prefixes (their keys) a policy instance has routed, bounded: for each, the engine it was sent to
    while no engine was yet seen holding it (a *pending* placement), or ``SETTLED`` once one was. Two
    generations of dicts, the older dropped when the newer fills, so a prefix is remembered for between half
    and all of ``capacity`` later prefixes (an approximate LRU at the cost of a dict lookup a request)."""

    __slots__ = ("_capacity", "_newer", "_older")

    def __init__(self, capacity: int) -> None:
        self._capacity = max(2, capacity)
        self._newer: dict[int, str] = {}
        self._older: dict[int, str] = {}

    def get(self, key: int) -> str | None:
        """The pending engine of ``key``, ``SETTLED``, or None: never routed (or forgotten)."""
        state = self._newer.get(key)
        return self._older.get(key) if state is None else state

    def set(self, key: int, state: str) -> None:
        self._newer[key] = state
        if len(self._newer) >= self._capacity // 2:
            self._older, self._newer = self._newer, {}


# A placement's state once an engine was seen holding the prefix (no engine id is empty).
SETTLED = ""


# prefix_affinity ranks this many engines at most (all of a smaller fleet): the gateway falls back down the
# list when a replica refuses, and past a handful of refusals the fleet is down, not one replica. Ranking
# 1,000 engines in Python per request would cost more than the whole routing budget.
MAX_RANKED_ENGINES = 16


@dataclass(slots=True)
class _Fleet:
    """What prefix_affinity can compute once per registry read (the router passes the same ``engines``
    tuple until the next one): per-engine arrays, the consistent-hash ring, and the engines closed to new
    affinity requests at each whole-number load bound (``closed_at``)."""

    engines: tuple[EngineView, ...]
    index: dict[str, int]
    loads: list[int]
    sum_loads: int
    ring: _Ring
    ids: tuple[str, ...]
    under_pressure: list[bool]
    # (load, engine) by load, highest first; and the closed sets made so far, by threshold.
    by_load: list[tuple[int, int]]
    _closed: dict[int, frozenset[int]]
    # The same engines and ring as the C step's arrays (affinity_native.py), or None where it is not built.
    native: object | None

    @classmethod
    def of(cls, engines: tuple[EngineView, ...]) -> _Fleet:
        loads = [e.load for e in engines]
        ids = tuple(e.engine_id for e in engines)
        index = {engine_id: i for i, engine_id in enumerate(ids)}
        ring = _ring(ids)
        native = native_fleet(engines, index, loads, ring.native, _CONSTANTS)
        return cls(engines, index, loads, sum(loads), ring, ids, [e.under_pressure for e in engines],
                   sorted(((load, i) for i, load in enumerate(loads)), reverse=True), {}, native)

    def closed_at(self, threshold: int) -> frozenset[int]:
        """Engines under pressure or with a heartbeat load of at least ``threshold``: closed to affinity
        requests while the bound is ``threshold`` (integer loads: ``load < bound`` is ``load < ceil(bound)``).
        A registry read sees a handful of thresholds, so each set is built once."""
        closed = self._closed.get(threshold)
        if closed is None:
            over = itertools.takewhile(lambda entry: entry[0] >= threshold, self.by_load)
            closed = self._closed[threshold] = frozenset(
                [i for _, i in over] + [i for i, flag in enumerate(self.under_pressure) if flag])
        return closed


_CONSTANTS = Constants(MAX_RANKED_ENGINES, BOUND_FACTOR, TOKENS_PER_RUNNING_REQUEST, TOKENS_PER_WAITING_REQUEST,
                       WAIT_STEP_TOKENS, MOVE_MARGIN_TOKENS, PENDING_PREFILL_STEP)

# How a prefix_affinity decision came about, for its reason (_affinity_rank.c words its reasons alike).
PLAIN, MOVED, PENDING, PLACED_BY_LOAD = 0, 1, 2, 3


def _reason(outcome: int, top_cached: int, top_load: int, holder_wait_s: float, any_cached: bool) -> str | None:
    """The decision's reason, or None for a request whose holders all rank after an uncredited engine (the
    policy names the holder's state then)."""
    if outcome == MOVED:
        return (f"prefix_affinity sooner elsewhere: holder's prefill wait {holder_wait_s * 1e3:.1f} ms, "
                f"cached_tokens={top_cached} load={top_load}")
    if outcome == PENDING:
        return f"prefix_affinity miss: pending where it was sent, load={top_load}"
    if outcome == PLACED_BY_LOAD:
        return f"prefix_affinity miss: new prefix, shortest backlog of its homes load={top_load}"
    if top_cached > 0:
        return f"prefix_affinity cached_tokens={top_cached} load={top_load}"
    if not any_cached:
        return f"prefix_affinity miss: home load={top_load}"
    return None


def _to_front(ranked: list[int], i: int) -> None:
    """Moves engine ``i`` to the head of a ranking of at most MAX_RANKED_ENGINES (the last one drops out
    when ``i`` was not in it)."""
    if ranked and ranked[0] == i:
        return
    if i in ranked:
        ranked.remove(i)
    else:
        del ranked[MAX_RANKED_ENGINES - 1:]
    ranked.insert(0, i)


def _least_backlogged(ranked: list[int], closed: frozenset[int], loads: dict[int, int], fleet: _Fleet,
                      bound: float, local_pending: Mapping[str, int], waits: Mapping[str, float],
                      fit: PrefillFit | None) -> int | None:
    """The open engine of ``ranked`` (under the bound, not closed) with the shortest prefill backlog, then the
    fewest requests (waiting ones counted twice), the first of equals (ranking order: ring order after the
    second-home swap); None where fewer than two are open (nothing to choose between). The backlog: with a
    ``fit``, the pod's prefill wait there (``waits``) in steps of WAIT_STEP_TOKENS' prefill time; without, the
    larger of the heartbeat's and the pod's pending tokens in steps of PENDING_PREFILL_STEP. A scan, not a sort:
    it stops at an idle engine with nothing to prefill once a second open one was met (nothing ranks before it),
    the usual case off peak. ``loads`` holds this pod's counts where they exceed the heartbeat's
    (``fleet.loads``)."""
    step_s = fit.s_per_token * WAIT_STEP_TOKENS if fit is not None else 0.0
    engines, ids, fleet_loads = fleet.engines, fleet.ids, fleet.loads
    best, best_key, num_open = -1, (0, 0), 0
    for i in ranked:
        load = loads.get(i, fleet_loads[i])
        if i in closed or load >= bound:
            continue
        num_open += 1
        if best >= 0 and best_key == (0, 0):
            break
        requests = load + engines[i].num_waiting
        if best >= 0 and best_key[0] == 0 and requests >= best_key[1]:
            continue  # even with nothing to prefill it would not come first: its backlog is not read
        if step_s > 0:
            backlog = int(waits.get(ids[i], 0.0) / step_s)
        else:
            pending_tokens = engines[i].pending_prefill_tokens
            if local_pending:
                pending_tokens = max(pending_tokens, local_pending.get(ids[i], 0))
            backlog = pending_tokens // PENDING_PREFILL_STEP
        engine_key = (backlog, requests)
        if best < 0 or engine_key < best_key:
            best, best_key = i, engine_key
    return best if num_open >= 2 else None


def _sooner_elsewhere(ranked: list[int], closed: frozenset[int], loads: dict[int, int], fleet: _Fleet,
                      bound: float, cached: dict[int, int], waits: Mapping[str, float], fit: PrefillFit) -> int | None:
    """For a hit whose holder ranks first: the open engine of ``ranked`` (under the bound, not closed) where its
    first token should come soonest, if sooner than at the holder by more than MOVE_MARGIN_TOKENS' prefill time;
    else None. The first token at engine i comes after its wait and the prefill of the prompt less what i holds:
    ``waits[i] + fit.seconds(prompt - cached[i])``; the fit's intercept and the prompt are common to all, so the
    comparison is of ``waits[i] - s_per_token * cached[i]``."""
    ids, fleet_loads = fleet.ids, fleet.loads
    holder = ranked[0]
    holder_wait = waits.get(ids[holder], 0.0)
    if holder_wait <= 0:
        return None  # nothing queued before it at its holder: nowhere is sooner
    per_token = fit.s_per_token
    best, best_cost = None, holder_wait - per_token * (cached[holder] + MOVE_MARGIN_TOKENS)
    for i in ranked[1:]:
        # A wait is never negative, so ``-per_token * cached`` is the cost's floor: an engine whose floor cannot
        # beat the best so far is passed without reading its wait (a sum over the pod's rows). Once an open engine
        # with nothing queued and nothing cached is met (cost 0), only holders' waits are read.
        floor = -per_token * cached.get(i, 0)
        if floor >= best_cost or i in closed or loads.get(i, fleet_loads[i]) >= bound:
            continue
        cost = waits.get(ids[i], 0.0) + floor
        if cost < best_cost:
            best, best_cost = i, cost
    return best


@register("prefix_affinity")
def _prefix_affinity() -> PolicyFn:
    """Consistent hashing with bounded loads, where the index's cached tokens come first.

    Engines at or over the load bound (``BOUND_FACTOR`` x mean load + 1) rank after every engine under it.
    Under the bound, the engine that would reuse the most cached tokens (from the KV-event index) wins;
    between equal caches the less busy one (load priced in tokens); and where nobody holds the prefix, the
    prefix's *home*: the first engine under the bound on the ring, walking clockwise from the prefix's first
    block hash (holders all over the bound: see below). Every gateway process computes the same homes.

    Why load does not outweigh a cache under the bound (issue #17, docs/routing.md): a request moved off
    the engine that holds its prefix prefills the whole prefix elsewhere and evicts another prefix there;
    a prefix placed by load rather than by its hash lands on a different engine each time it is evicted,
    so with small caches every engine ends up cycling every prefix. Under overload both feed themselves.
    The bound alone keeps any engine under twice the mean load (+1).

    A prefix nobody holds that this policy has never routed is the exception: it goes to the open home with
    the shortest prefill backlog, then the fewest requests (a long cold prefill does not queue behind another,
    nor in front of a hot prefix's hits, while an engine has none); so does a request whose holders are all
    over the bound. Until the index shows an engine holding a new prefix, its later requests go where it was
    sent (while that engine is open); then they follow its blocks, and once evicted it goes to its first home.

    Once the router has learned how long a prefill takes (``snapshot.prefill_fit``, prefill_clock.py), backlogs
    are waits in time, not tokens, and a hit is the other exception: it goes to another open engine of its
    ranking where its first token comes sooner than behind its holder's queue, by a margin (``_sooner_elsewhere``).

    Cost: O(engines holding the prefix + engines with this gateway's requests in flight + the ring walk to
    ``MAX_RANKED_ENGINES`` engines under the bound), not O(fleet).

    Where ``make install`` built it, the usual decision is taken in C (``_affinity_rank.c``, affinity_native.py)
    and this Python takes the rest: a change to a rule here is a change there too, and
    tests/unit/routing/test_affinity_native.py, which holds the two to the same decisions, fails until both agree."""
    # Each model's fleet by the id of its engines tuple: a fleet holds its tuple, so no other object can have
    # that id while the entry lives. Rebuilt by ``prepare`` at each registry read; a decision over engines it
    # has not seen (a plan made before the read) builds one itself.
    fleets: dict[int, _Fleet] = {}
    placements = _Placements(SEEN_PREFIXES)

    def fleet_of(engines: tuple[EngineView, ...]) -> _Fleet:
        fleet = fleets.get(id(engines))
        if fleet is None:
            if len(fleets) >= MAX_CACHED_FLEETS:
                fleets.clear()
            fleet = fleets[id(engines)] = _Fleet.of(engines)
        return fleet

    def prepare(models: list[tuple[EngineView, ...]]) -> None:
        fleets.clear()
        for engines in models:
            if engines:
                fleet = fleet_of(engines)
                # The closed set at the heartbeats' own bound, the one most decisions until the next read use.
                fleet.closed_at(math.ceil(_load_bound(fleet.sum_loads, len(engines))))

    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        fleet = fleets.get(id(snapshot.engines)) or fleet_of(snapshot.engines)
        key = request.block_hashes[0] if request.block_hashes else _engine_salt(request.session_id or request.tenant)
        if fleet.native is not None:
            native = rank_natively(fleet.native, snapshot, request.num_prompt_tokens, key, placements.get(key))
            if native is not None:  # the C step's decision (affinity_native.py), worded as _reason words it
                decision, place = native
                if place is not None:
                    placements.set(key, place)
                return decision
        engines, index, fleet_loads = fleet.engines, fleet.index, fleet.loads
        # Load = max(heartbeat, this gateway's in-flight count): only engines with requests in flight change.
        loads: dict[int, int] = {}
        sum_loads = fleet.sum_loads
        for engine_id, num in snapshot.local_in_flight.items():
            i = index.get(engine_id)
            if i is not None and num > fleet_loads[i]:
                loads[i] = num
                sum_loads += num - fleet_loads[i]
        bound = _load_bound(sum_loads, len(engines))
        # vLLM recomputes at least the last prompt token, so a fully cached, block-aligned prompt still
        # prefills its last block: credit at most what it can reuse.
        reusable = max(request.num_prompt_tokens - 1, 0)
        cached: dict[int, int] = {}
        for engine_id, num_blocks in snapshot.cached_prefix_blocks.items():
            i = index.get(engine_id)
            if i is not None and num_blocks > 0:
                size = engines[i].block_size
                cached[i] = min(num_blocks * size, reusable // size * size if size > 0 else 0)
        # The prefix's homes: the engines in ring order from its key, up to MAX_RANKED_ENGINES open to it
        # (under the bound, not under pressure) or all of them; an engine's rank is its place in that walk.
        # Engines beyond it rank after every one in it.
        num_engines = len(engines)
        ring = fleet.ring
        # Closed engines: the fleet's at this bound, and those this gateway's own requests took over it (a
        # local load only ever raises an engine's).
        closed = fleet.closed_at(math.ceil(bound))
        if loads and (extra := [i for i, load in loads.items() if load >= bound]):
            closed = closed.union(extra)
        walk_len = min(num_engines, 2 * MAX_RANKED_ENGINES)
        while True:
            walk = ring.walk(key, walk_len)
            # The open homes met, in ring order (filterfalse and islice: the walk is scanned in C; with
            # nothing closed, the usual case below the bound, not scanned at all).
            walk_open = (list(itertools.islice(itertools.filterfalse(closed.__contains__, walk), MAX_RANKED_ENGINES))
                         if closed else list(walk[:MAX_RANKED_ENGINES]))
            if len(walk_open) == MAX_RANKED_ENGINES or walk_len == num_engines:
                break
            walk_len = min(num_engines, 4 * walk_len)  # many engines over the bound: look further

        # Two homes per prefix: the second takes the first's place while it is idle and the first is not,
        # so two cold prompts do not queue on one engine while another sits idle. Only idle capacity
        # counts: a busy fleet keeps one home per prefix (a second copy evicts another prefix).
        swapped: dict[int, int] = {}
        if len(walk_open) >= 2:
            first, second = walk_open[0], walk_open[1]
            if loads.get(second, fleet_loads[second]) == 0 < loads.get(first, fleet_loads[first]):
                swapped = {first: second, second: first}
                walk_open[0], walk_open[1] = second, first

        def home_rank(i: int) -> int:
            # An engine's place on the ring from the prefix's key: the distance to its first point orders
            # engines as the walk does (``_Ring.offset``), without walking to an engine beyond the walk.
            return ring.offset(key, swapped.get(i, i))

        def rank_key(i: int) -> tuple[bool, bool, int, int, int]:
            load = loads.get(i, fleet_loads[i])
            over = load >= bound
            credit = 0 if over else cached.get(i, 0)
            price = (TOKENS_PER_RUNNING_REQUEST * load + TOKENS_PER_WAITING_REQUEST * engines[i].num_waiting
                     if credit else 0)
            return engines[i].under_pressure, over, -credit, price, home_rank(i)

        if len(walk_open) == MAX_RANKED_ENGINES:
            # The usual case, without a key per candidate: every open engine ranks before every closed one,
            # and MAX_RANKED_ENGINES open ones were met, so the ranking is the open holders with credit (by
            # rank_key) and then the walk's open engines in ring order. (An open engine beyond the walk without
            # credit ranks after all of them.) Equal to the full sort below (tests/unit/routing/test_policies.py).
            credited = [i for i, tokens in cached.items() if tokens and i not in closed]
            if len(credited) > 1:  # one holder (the usual hit) needs no key
                credited.sort(key=rank_key)
            ranked = credited + [i for i in walk_open if not cached.get(i)] if credited else walk_open
            del ranked[MAX_RANKED_ENGINES:]
        else:
            # Fewer open engines than that: the walk went round the whole fleet, so every engine is scored
            # (closed ones too, the pressured last) and placed by its rank in the walk.
            walked = {i: rank for rank, i in enumerate(walk)}
            walked.update({i: walked[j] for i, j in swapped.items()})

            def full_key(i: int) -> tuple[bool, bool, int, int, int]:
                under, over, credit, price, _ = rank_key(i)
                return under, over, credit, price, walked[i]

            ranked = sorted({*walked, *loads, *cached}, key=full_key)[:MAX_RANKED_ENGINES]

        placed_by_load = pending = False
        moved_from = -1
        fit, waits = snapshot.prefill_fit, snapshot.prefill_wait_s
        state = placements.get(key)
        if cached:
            if state != SETTLED:
                placements.set(key, SETTLED)
            if fit is not None and cached.get(ranked[0]):
                # A hit goes where its first token comes sooner by a margin, if anywhere (_sooner_elsewhere).
                sooner = _sooner_elsewhere(ranked, closed, loads, fleet, bound, cached, waits, fit)
                if sooner is not None:
                    moved_from = ranked[0]
                    _to_front(ranked, sooner)
            elif not cached.get(ranked[0]) and any(cached.values()):
                # Every holder is over the bound (or under pressure): the request prefills its whole prompt
                # wherever it goes, so it goes where the least prefill is queued, as a new prefix does.
                best = _least_backlogged(ranked, closed, loads, fleet, bound, snapshot.local_pending_prefill_tokens,
                                         waits, fit)
                if best is not None:
                    _to_front(ranked, best)
        elif state is None:
            best = _least_backlogged(ranked, closed, loads, fleet, bound, snapshot.local_pending_prefill_tokens,
                                     waits, fit)
            if best is not None:
                _to_front(ranked, best)
                placed_by_load = True
            placements.set(key, fleet.ids[ranked[0]])
        elif state != SETTLED:
            # Sent before and no engine seen holding it since: its blocks are on their way to that engine
            # (a prefill, then the KV events' lag). It follows them there while that engine is open.
            i = index.get(state)
            if i is not None and i not in closed and loads.get(i, fleet_loads[i]) < bound:
                _to_front(ranked, i)
                pending = True
            else:
                placements.set(key, fleet.ids[ranked[0]])
        top = ranked[0]
        top_cached, top_load = cached.get(top, 0), loads.get(top, fleet_loads[top])
        outcome = MOVED if moved_from >= 0 else PENDING if pending else PLACED_BY_LOAD if placed_by_load else PLAIN
        holder_wait_s = waits.get(fleet.ids[moved_from], 0.0) if moved_from >= 0 else 0.0
        reason = _reason(outcome, top_cached, top_load, holder_wait_s, bool(cached))
        if reason is None:
            holder = max(cached, key=lambda i: (cached[i], -loads.get(i, fleet_loads[i])))
            if (holder_load := loads.get(holder, fleet_loads[holder])) >= bound:
                reason = f"prefix_affinity bounded_load: holder load {holder_load} >= {bound:.1f}, load={top_load}"
            else:
                reason = f"prefix_affinity holder under kv pressure, load={top_load}"
        return RouteDecision(tuple(map(fleet.ids.__getitem__, ranked)), reason, top_cached)

    _PREPARERS[policy] = prepare
    return policy
