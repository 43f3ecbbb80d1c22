"""The engine registry in Redis: every replica announces its address, model, KV geometry and load.

Layout:
  tessera:engines                ZSET engine_id -> last heartbeat (Redis server time, seconds)
  tessera:engine:<id>            HASH of EngineRecord fields; TTL = ENGINE_TTL_FACTOR x heartbeat interval
  tessera:engine:<id>:pressure   "1" while the KV-eviction controller flags the engine (TTL'd by it)

A replica that stops heartbeating drops out by itself: its hash expires and readers ignore ZSET members
whose last heartbeat is older than the TTL (``live_engines`` prunes them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields

import redis.asyncio as aioredis

from tessera.redis_wire import RedisWire, run_script

ENGINES_ZSET = "tessera:engines"
ENGINE_TTL_FACTOR = 5


def engine_key(engine_id: str) -> str:
    return f"tessera:engine:{engine_id}"


def pressure_key(engine_id: str) -> str:
    return f"tessera:engine:{engine_id}:pressure"


@dataclass(slots=True)
class EngineRecord:
    engine_id: str
    url: str
    model: str
    block_size: int
    num_gpu_blocks: int
    max_model_len: int
    kv_events_endpoint: str = ""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    # Prompt tokens of the requests running here that await their first token (as the gateways declared them:
    # what a new request would queue behind; routing/policies.py rule 6).
    pending_prefill_tokens: int = 0
    # What runs, which may differ from the config where the platform cannot run it (engine/capabilities.py).
    kv_cache_dtype: str = ""
    kv_capacity_tokens: int = 0
    speculative_method: str = ""
    fallbacks: str = ""  # one line per fallback
    under_pressure: bool = False
    heartbeat_ts: float = 0.0

    def to_redis(self) -> dict[str, str]:
        return {k: str(int(v) if isinstance(v, bool) else v) for k, v in asdict(self).items()}

    @classmethod
    def from_redis(cls, raw: dict[bytes, bytes]) -> EngineRecord:
        values: dict[str, object] = {}
        for f in fields(cls):
            text = raw.get(f.name.encode())
            if text is None:
                continue
            decoded = text.decode()
            if f.type in ("int",):
                values[f.name] = int(decoded)
            elif f.type in ("float",):
                values[f.name] = float(decoded)
            elif f.type in ("bool",):
                values[f.name] = decoded == "1"
            else:
                values[f.name] = decoded
        return cls(**values)  # type: ignore[arg-type]

    @property
    def load(self) -> int:
        return self.num_running + self.num_waiting


# One round trip: prune dead members, return live records with their pressure flags.
_LIVE_ENGINES_LUA = """
local now = tonumber(redis.call('TIME')[1])
local max_age = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - max_age)
local ids = redis.call('ZRANGE', KEYS[1], 0, -1)
local out = {}
for _, id in ipairs(ids) do
  local h = redis.call('HGETALL', 'tessera:engine:' .. id)
  if #h > 0 then
    table.insert(h, 'under_pressure')
    table.insert(h, redis.call('EXISTS', 'tessera:engine:' .. id .. ':pressure'))
    table.insert(out, h)
  end
end
return out
"""

_HEARTBEAT_LUA = """
local now = tonumber(redis.call('TIME')[1])
redis.call('HSET', KEYS[2], unpack(ARGV, 2, #ARGV - 1))
redis.call('HSET', KEYS[2], 'heartbeat_ts', now)
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[1]))
redis.call('ZADD', KEYS[1], now, ARGV[#ARGV])
return now
"""


class EngineRegistry:
    """``wire``: a lean Redis connection (redis_wire.py), when the caller has one; ``live_engines`` then
    reads over it (the gateway's registry refresher, once a second on every worker) instead of redis-py."""

    def __init__(self, redis: aioredis.Redis, heartbeat_interval_s: float = 1.0,
                 wire: RedisWire | None = None) -> None:
        self._redis = redis
        self._wire = wire
        self._ttl_s = max(2, int(ENGINE_TTL_FACTOR * heartbeat_interval_s))
        self._live = redis.register_script(_LIVE_ENGINES_LUA)
        self._heartbeat = redis.register_script(_HEARTBEAT_LUA)

    async def heartbeat(self, record: EngineRecord) -> None:
        await self._heartbeat(*self._heartbeat_call(record))

    async def heartbeat_many(self, records: Sequence[EngineRecord]) -> None:
        """Several replicas' heartbeats in one round trip (a simulated fleet's: at 1,000 replicas a round trip
        each cost the fleet's one event loop a fifth of its time)."""
        pipe = self._redis.pipeline(transaction=False)
        for record in records:
            await self._heartbeat(*self._heartbeat_call(record), client=pipe)  # queued, sent by execute
        await pipe.execute()

    def _heartbeat_call(self, record: EngineRecord) -> tuple[list[str], list[str | int]]:
        flat: list[str] = []
        for k, v in record.to_redis().items():
            if k in ("heartbeat_ts", "under_pressure"):
                continue
            flat += [k, v]
        # The engine id is the last ARGV so the script can ZADD it.
        return [ENGINES_ZSET, engine_key(record.engine_id)], [self._ttl_s, *flat, record.engine_id]

    async def deregister(self, engine_id: str) -> None:
        await self._redis.zrem(ENGINES_ZSET, engine_id)
        await self._redis.delete(engine_key(engine_id))

    async def live_engines(self) -> list[EngineRecord]:
        rows = await run_script(self._wire, self._live, [ENGINES_ZSET], [self._ttl_s])
        records = []
        for row in rows:
            raw = {row[i]: row[i + 1] for i in range(0, len(row), 2)}
            raw[b"under_pressure"] = b"1" if int(raw[b"under_pressure"]) else b"0"
            records.append(EngineRecord.from_redis(raw))
        return records


MODELS_HASH = "tessera:models"


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What a gateway needs to serve a model without asking an engine: tokenizer and context limits."""

    name: str
    tokenizer: str
    max_model_len: int
    block_size: int


async def register_model(redis: aioredis.Redis, info: ModelInfo) -> None:
    import json

    await redis.hset(MODELS_HASH, info.name, json.dumps(asdict(info)))


async def list_models(redis: aioredis.Redis) -> list[ModelInfo]:
    import json

    raw = await redis.hgetall(MODELS_HASH)
    return [ModelInfo(**json.loads(v)) for v in raw.values()]
