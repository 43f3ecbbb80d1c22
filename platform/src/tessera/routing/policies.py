"""Routing policies: pure functions over a ``RouteSnapshot``, registered by name.

Every policy returns *all* live engines ranked best-first (the gateway falls back down the list when a
replica refuses) and a short reason that ends up in ``x-tessera-route-reason`` and the trace. Engines the
KV-eviction controller flags as under pressure always rank after the others.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from tessera.routing.snapshot import EngineView, RouteDecision, RouteRequest, RouteSnapshot

PolicyFn = Callable[[RouteSnapshot, RouteRequest], RouteDecision]
_REGISTRY: dict[str, Callable[[], PolicyFn]] = {}


def register(name: str) -> Callable[[Callable[[], PolicyFn]], Callable[[], PolicyFn]]:
    def wrap(factory: Callable[[], PolicyFn]) -> Callable[[], PolicyFn]:
        _REGISTRY[name] = factory
        return factory

    return wrap


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


def _by_load(snapshot: RouteSnapshot) -> list[EngineView]:
    return sorted(snapshot.engines, key=lambda e: (e.under_pressure, _load(e, snapshot), e.kv_cache_usage, e.engine_id))


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
    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        order = _by_load(snapshot)
        return RouteDecision(tuple(e.engine_id for e in order), f"least_loaded load={_load(order[0], snapshot)}")

    return policy


def _rendezvous(key: str, engine_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{engine_id}".encode(), digest_size=8).digest(), "big")


@register("session_affinity")
def _session_affinity() -> PolicyFn:
    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        if request.session_id is None:
            order = _by_load(snapshot)
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
BOUND_FACTOR = 1.25
# Load priced in cached tokens. A running request costs little (continuous batching shares each step), a
# waiting one delays the first token until a slot frees: a 1,000-token cached prefix outweighs about
# 15 running requests but only two waiting ones.
TOKENS_PER_RUNNING_REQUEST = 64
TOKENS_PER_WAITING_REQUEST = 512


@lru_cache(maxsize=4096)
def _engine_salt(engine_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(engine_id.encode(), digest_size=8).digest(), "big")


def _tie_rank(key: int, engine_id: str) -> int:
    """Rendezvous weight of (key, engine), the same in every gateway process: CPython hashes tuples of
    ints without the per-process string-hash seed."""
    return hash((key, _engine_salt(engine_id)))


# prefix_affinity ranks this many engines at most (all of a smaller fleet): the gateway falls back down the
# list when a replica refuses, and past a handful of refusals the fleet is down, not one replica. Ranking
# 1,000 engines in Python per request would cost more than the whole routing budget.
MAX_RANKED_ENGINES = 16


@dataclass(slots=True)
class _Fleet:
    """What prefix_affinity can compute once per registry read (the router passes the same ``engines``
    tuple until the next one): per-engine arrays, and the engines ordered by (pressure, load price, id)."""

    engines: tuple[EngineView, ...]
    index: dict[str, int]
    loads: list[int]
    sum_loads: int
    order: list[int]

    @classmethod
    def of(cls, engines: tuple[EngineView, ...]) -> _Fleet:
        loads = [e.load for e in engines]
        order = sorted(range(len(engines)), key=lambda i: (
            engines[i].under_pressure,
            TOKENS_PER_RUNNING_REQUEST * loads[i] + TOKENS_PER_WAITING_REQUEST * engines[i].num_waiting,
            engines[i].engine_id))
        return cls(engines, {e.engine_id: i for i, e in enumerate(engines)}, loads, sum(loads), order)


@register("prefix_affinity")
def _prefix_affinity() -> PolicyFn:
    """Expected cached tokens (from the KV-event index) minus load priced in tokens; an engine over the
    bounded-load limit gets no credit for its cache, so a hot prefix spills to a second engine.

    Cost: O(engines holding the prefix + engines with this gateway's requests in flight + the best tie
    group), not O(fleet): only those engines' scores differ from the per-registry-read order (``_Fleet``).
    The ranking is exact for the first ``MAX_RANKED_ENGINES``; engines tied on score beyond the best group
    keep engine-id order."""
    fleet_cache: list[_Fleet] = []

    def fleet_of(engines: tuple[EngineView, ...]) -> _Fleet:
        if not fleet_cache or fleet_cache[0].engines is not engines:
            fleet_cache[:] = [_Fleet.of(engines)]
        return fleet_cache[0]

    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        fleet = fleet_of(snapshot.engines)
        engines, index = fleet.engines, fleet.index
        # Load = max(heartbeat, this gateway's in-flight count): only engines with requests in flight change.
        loads: dict[int, int] = {}
        sum_loads = fleet.sum_loads
        for engine_id, num in snapshot.local_in_flight.items():
            i = index.get(engine_id)
            if i is not None and num > fleet.loads[i]:
                loads[i] = num
                sum_loads += num - fleet.loads[i]
        bound = BOUND_FACTOR * sum_loads / len(engines) + 1
        # vLLM recomputes at least the last prompt token, so a fully cached, block-aligned prompt still
        # prefills its last block: credit at most what it can reuse.
        reusable = max(request.num_prompt_tokens - 1, 0)
        cached: dict[int, int] = {}
        for engine_id, num_blocks in snapshot.cached_prefix_blocks.items():
            i = index.get(engine_id)
            if i is not None and num_blocks > 0:
                size = engines[i].block_size
                cached[i] = min(num_blocks * size, reusable // size * size if size > 0 else 0)
        # Candidates: engines whose score differs from the fleet order's, plus enough of that order to fill
        # the ranking and its whole best tie group (ties go to the rendezvous winner, below).
        picked = set(loads) | set(cached)
        num_head = MAX_RANKED_ENGINES + len(picked)
        rest = [i for i in fleet.order[:num_head] if i not in picked]

        def price(i: int) -> tuple[bool, int]:
            load = loads.get(i, fleet.loads[i])
            credit = cached.get(i, 0) if load < bound else 0
            return engines[i].under_pressure, -(credit - TOKENS_PER_RUNNING_REQUEST * load
                                                 - TOKENS_PER_WAITING_REQUEST * engines[i].num_waiting)

        if rest:
            best = price(rest[0])
            for i in fleet.order[num_head:]:
                if i in picked:
                    continue
                if price(i) != best:
                    break
                rest.append(i)  # the best group continues past the ranking's length: all of it competes
        # Equal scores (typically: nobody holds the prefix and loads tie) go to the prefix's rendezvous
        # winner, so distinct prefixes spread over the fleet and every gateway places a new prefix on the
        # same engine before the index has heard of it.
        key = request.block_hashes[0] if request.block_hashes else _engine_salt(request.session_id or request.tenant)
        ranked = sorted([*picked, *rest], key=lambda i: (*price(i), -_tie_rank(key, engines[i].engine_id)))
        ranked = ranked[:MAX_RANKED_ENGINES]
        top = ranked[0]
        top_cached, top_load = cached.get(top, 0), loads.get(top, fleet.loads[top])
        holder = max(cached, key=lambda i: (cached[i], -loads.get(i, fleet.loads[i])), default=None)
        if top_cached > 0:
            reason = f"prefix_affinity cached_tokens={top_cached} load={top_load}"
        elif holder is None or cached[holder] == 0:
            reason = f"prefix_affinity miss: least_loaded load={top_load}"
        elif (holder_load := loads.get(holder, fleet.loads[holder])) >= bound:
            reason = f"prefix_affinity bounded_load: holder load {holder_load} >= {bound:.1f}, load={top_load}"
        else:
            reason = f"prefix_affinity load outweighs {cached[holder]} cached tokens, load={top_load}"
        return RouteDecision(tuple(engines[i].engine_id for i in ranked), reason, top_cached)

    return policy
