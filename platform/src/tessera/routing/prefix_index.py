"""Which engine holds which KV block, shared by every gateway through Redis and fed by the engines' own
KV events, so it forgets a prefix the moment an engine evicts it.

Layout:
  tessera:pfx:<hash>          SET of engine ids holding the block (TTL refreshed on every store)
  tessera:pfx-engine:<id>     SET of hashes the engine holds (to drop them all on AllBlocksCleared / death)

Invariant: after applying an engine's events in order, ``tessera:pfx:<h>`` contains the engine iff the
engine's last event about ``h`` was BlockStored. A lookup walks the request's chain from the first block
and returns, per live engine, the length of the longest chain prefix it holds — one Lua call, one round
trip, whatever the chain length.
"""

from __future__ import annotations

import redis.asyncio as aioredis

# Garbage from engines that died without clearing expires after this long (live entries are refreshed).
BLOCK_TTL_S = 3600


def block_key(block_hash: int) -> str:
    return f"tessera:pfx:{block_hash}"


def engine_blocks_key(engine_id: str) -> str:
    return f"tessera:pfx-engine:{engine_id}"


_LOOKUP_LUA = """
local n = tonumber(ARGV[1])
local depth, alive = {}, {}
for i = 2, n + 1 do alive[ARGV[i]] = true; depth[ARGV[i]] = 0 end
for j = n + 2, #ARGV do
  local level = j - n - 1
  local holders = redis.call('SMEMBERS', 'tessera:pfx:' .. ARGV[j])
  local advanced = false
  for _, id in ipairs(holders) do
    if alive[id] and depth[id] == level - 1 then depth[id] = level; advanced = true end
  end
  if not advanced then break end
end
local out = {}
for id, d in pairs(depth) do if d > 0 then table.insert(out, id); table.insert(out, d) end end
return out
"""


class PrefixIndex:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._lookup = redis.register_script(_LOOKUP_LUA)

    async def longest_prefixes(self, chain: tuple[int, ...], engine_ids: list[str]) -> dict[str, int]:
        if not chain or not engine_ids:
            return {}
        flat = await self._lookup(keys=[], args=[len(engine_ids), *engine_ids, *chain])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def apply(self, engine_id: str, ops: list[tuple[str, int]]) -> None:
        """Applies an engine's events in order: ("store", h), ("remove", h) or ("clear", 0)."""
        pipe = self._redis.pipeline(transaction=False)
        for op, h in ops:
            if op == "clear":
                await pipe.execute()
                await self.clear_engine(engine_id)
                pipe = self._redis.pipeline(transaction=False)
            elif op == "remove":
                pipe.srem(block_key(h), engine_id)
                pipe.srem(engine_blocks_key(engine_id), h)
            else:
                pipe.sadd(block_key(h), engine_id)
                pipe.expire(block_key(h), BLOCK_TTL_S)
                pipe.sadd(engine_blocks_key(engine_id), h)
                pipe.expire(engine_blocks_key(engine_id), BLOCK_TTL_S)
        await pipe.execute()

    async def clear_engine(self, engine_id: str) -> None:
        hashes = await self._redis.smembers(engine_blocks_key(engine_id))
        pipe = self._redis.pipeline(transaction=False)
        for h in hashes:
            pipe.srem(block_key(int(h)), engine_id)
        pipe.delete(engine_blocks_key(engine_id))
        await pipe.execute()

    async def blocks_of(self, engine_id: str) -> set[int]:
        return {int(h) for h in await self._redis.smembers(engine_blocks_key(engine_id))}
