"""Routing policies: pure functions over a ``RouteSnapshot``, registered by name.

Every policy returns *all* live engines ranked best-first (the gateway falls back down the list when a
replica refuses) and a short reason that ends up in ``x-tessera-route-reason`` and the trace. Engines the
KV-eviction controller flags as under pressure always rank after the others.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

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


@dataclass
class _ApproxState:
    owner: dict[bytes, str] = field(default_factory=dict)


@register("approx_prefix")
def _approx_prefix() -> PolicyFn:
    """Baseline like production-stack's prefix router: remembers where it *sent* each character-prefix
    chunk, never learns that the engine evicted it."""
    state = _ApproxState()

    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        live = {e.engine_id for e in snapshot.engines}
        digest = hashlib.blake2b(request.model.encode(), digest_size=16)
        chain: list[bytes] = []
        text = request.prompt_prefix
        for start in range(0, len(text) - len(text) % APPROX_CHUNK_CHARS, APPROX_CHUNK_CHARS):
            digest.update(text[start:start + APPROX_CHUNK_CHARS].encode())
            chain.append(digest.copy().digest())
        best, matched = None, 0
        for depth, key in enumerate(chain, start=1):
            owner = state.owner.get(key)
            if owner is None or owner not in live:
                break
            best, matched = owner, depth
        order = _by_load(snapshot)
        if best is not None:
            order = [e for e in order if e.engine_id == best] + [e for e in order if e.engine_id != best]
        chosen = order[0].engine_id
        for key in chain:
            state.owner[key] = chosen
        reason = f"approx_prefix matched_chunks={matched}" if best else "approx_prefix miss: least_loaded"
        return RouteDecision(_pressure_last(order), reason)

    return policy


# Bounded load (consistent hashing with bounded loads, Mirrokni et al.): an engine may take an affinity
# request only while its load stays below BOUND_FACTOR x mean load (+1 so an idle fleet still has room).
BOUND_FACTOR = 1.25
# Load priced in cached tokens. A running request costs little (continuous batching shares each step), a
# waiting one delays the first token until a slot frees: a 1,000-token cached prefix outweighs about
# 15 running requests but only two waiting ones.
TOKENS_PER_RUNNING_REQUEST = 64
TOKENS_PER_WAITING_REQUEST = 512


@register("prefix_affinity")
def _prefix_affinity() -> PolicyFn:
    def policy(snapshot: RouteSnapshot, request: RouteRequest) -> RouteDecision:
        if (empty := _empty(snapshot)) is not None:
            return empty
        loads = {e.engine_id: _load(e, snapshot) for e in snapshot.engines}
        mean = sum(loads.values()) / len(loads)
        bound = BOUND_FACTOR * mean + 1

        def cached_tokens(e: EngineView) -> int:
            return snapshot.cached_prefix_blocks.get(e.engine_id, 0) * e.block_size

        def score(e: EngineView) -> float:
            cached = cached_tokens(e) if loads[e.engine_id] < bound else 0
            return (cached - TOKENS_PER_RUNNING_REQUEST * loads[e.engine_id]
                    - TOKENS_PER_WAITING_REQUEST * e.num_waiting)

        order = sorted(snapshot.engines, key=lambda e: (e.under_pressure, -score(e), e.kv_cache_usage, e.engine_id))
        top = order[0]
        best_cached = max(cached_tokens(e) for e in snapshot.engines)
        if cached_tokens(top) > 0:
            reason = f"prefix_affinity cached_tokens={cached_tokens(top)} load={loads[top.engine_id]}"
        elif best_cached > 0:
            reason = f"prefix_affinity bounded_load: holder over {bound:.1f}, load={loads[top.engine_id]}"
        else:
            reason = f"prefix_affinity miss: least_loaded load={loads[top.engine_id]}"
        return RouteDecision(tuple(e.engine_id for e in order), reason, cached_tokens(top))

    return policy
