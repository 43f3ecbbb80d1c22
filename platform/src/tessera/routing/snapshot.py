"""What a routing policy sees: small frozen values, no Redis, no HTTP (policies are pure functions)."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


@dataclass(frozen=True, slots=True)
class RouteRequest:
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


@dataclass(frozen=True, slots=True)
class RouteSnapshot:
    engines: tuple[EngineView, ...]
    # engine_id -> how many leading blocks of this request's chain that engine holds (from KV events).
    cached_prefix_blocks: dict[str, int] = field(default_factory=dict)
    # engine_id -> requests this gateway routed there and has not seen finish (fresher than heartbeats).
    local_in_flight: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    ranked: tuple[str, ...]
    reason: str
    expected_cached_tokens: int = 0
