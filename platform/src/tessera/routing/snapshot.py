"""What a routing policy sees: small immutable values, no Redis, no HTTP (policies are pure functions).

The values made per request (``RouteRequest``, ``RouteSnapshot``, ``RouteDecision``) are NamedTuples: as
immutable as a frozen dataclass, and several times cheaper to build (a frozen dataclass sets each field
through ``object.__setattr__``: ~1 µs a value, on a routing decision whose goal is 50 µs, issue #17).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from tessera.routing.prefill_clock import PrefillFit

# The empty default of a snapshot's mappings: read-only, so one object can serve every snapshot.
_NONE: Mapping[str, int] = MappingProxyType({})
_NO_WAITS: Mapping[str, float] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EngineView:
    engine_id: str
    url: str
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_gpu_blocks: int
    block_size: int
    under_pressure: bool = False
    # Prompt tokens the replica holds that await their first token (its heartbeat; declared by the gateways).
    pending_prefill_tokens: int = 0

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


class RouteRequest(NamedTuple):
    tenant: str
    model: str
    num_prompt_tokens: int
    # Parent-chained block hashes of the prompt's full blocks, salted per tenant (see hashing.py).
    block_hashes: tuple[int, ...] = ()
    # Leading characters of the prompt text (approx_prefix baseline only).
    prompt_prefix: str = ""
    session_id: str | None = None
    # The tenant's prefix-cache salt (None when its policy shares the cache): approx_prefix keys its chunks
    # with it, as the block hashes above are.
    cache_salt: str | None = None


class RouteSnapshot(NamedTuple):
    engines: tuple[EngineView, ...]
    # engine_id -> how many leading blocks of this request's chain that engine holds (from KV events).
    cached_prefix_blocks: Mapping[str, int] = _NONE
    # engine_id -> requests this gateway routed there and has not seen finish (fresher than heartbeats); every
    # policy reads max(heartbeat load, this), so a router may leave out the engines at or under their heartbeat's
    # load (routers do: pod_view.py).
    local_in_flight: Mapping[str, int] = _NONE
    # engine_id -> prompt tokens of those requests not yet past their first token (fresher than heartbeats).
    local_pending_prefill_tokens: Mapping[str, int] = _NONE
    # engine_id -> seconds until those prompts should be prefilled there, first come first served at the fit's
    # rate (routing/prefill_clock.py; engines with none left out), and the fit itself (None: too few samples
    # yet, and the policies price the backlog in tokens).
    prefill_wait_s: Mapping[str, float] = _NO_WAITS
    prefill_fit: PrefillFit | None = None


class RouteDecision(NamedTuple):
    ranked: tuple[str, ...]
    reason: str
    expected_cached_tokens: int = 0

    def tokens_to_prefill(self, num_prompt_tokens: int) -> int:
        """The prompt tokens the chosen engine must prefill, as the index saw its cache: what the gateway
        declares to the replica (``prefill_tokens``) and counts against it until the first token."""
        return max(0, num_prompt_tokens - self.expected_cached_tokens)
