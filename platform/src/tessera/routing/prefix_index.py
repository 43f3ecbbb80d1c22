"""Which engine holds which KV block, shared by every gateway through Redis and fed by the engines' own
KV events, so it forgets a prefix the moment an engine evicts it.

Layout (block hashes are the 64-bit ints KV events carry, written in decimal):
  tessera:pfx:<hash>          HASH engine_id -> copies of the block that engine holds (field absent = 0)
  tessera:pfx-engine:<id>     SET of hashes the engine holds (to drop them all on AllBlocksCleared / death)
  tessera:pfx-engines         ZSET engine_id -> Redis time of the engine's last applied batch
  tessera:pfx-seq             HASH engine_id -> number of batches (and clears) applied so far
  tessera:pfx-events          STREAM of those batches, for the gateways' in-process indexes
                              (local_feed.py): e engine, n its sequence number, t publication time,
                              o op letters (s store, r remove, c clear), h hashes (pack_hashes)

Why copies and not a set: vLLM does not de-duplicate identical blocks (``BlockHashToBlockMap``, NOTE #1).
Two requests that prefill the same prefix in the same step each cache a copy, each copy is announced by a
BlockStored, and evicting one copy announces a BlockRemoved while the other copy still serves hits.

Invariant (tests/unit/routing/test_prefix_index.py checks it exactly): after an engine's events are applied
in order, the engine's field in ``tessera:pfx:<h>`` equals c(h), where c starts at 0, a store adds 1, a
remove subtracts 1 but never goes below 0, and a clear resets every c to 0; the field is absent iff
c(h) = 0, and ``h`` is in ``tessera:pfx-engine:<id>`` iff the field is present. Each batch is one Lua call,
so a reader never sees half a batch.

Lookup: walk the request's chain from its first block and return, per *live* engine, how many leading
blocks of the chain it holds — what vLLM's ``find_longest_cache_hit`` would find there. One Lua call, one
round trip, whatever the chain length; engines not passed in as live are ignored, so a dead engine's
leftovers never attract a request even before they are swept.

Nothing here expires by TTL: a hot system prompt stored once and reused for hours (reuse emits no event)
must stay indexed. Leftovers of an engine that died without clearing are removed by ``sweep``.
NOTE: the scripts touch keys they compute, so the index needs a single Redis (not Redis Cluster).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis

BLOCK_PREFIX = "tessera:pfx:"
ENGINE_BLOCKS_PREFIX = "tessera:pfx-engine:"
ENGINES_KEY = "tessera:pfx-engines"
# Blocks dropped per Lua call when clearing an engine: bounds how long one call blocks Redis (~1 ms).
CLEAR_CHUNK = 2000
# An engine absent from the registry is swept only once it has also applied nothing for this long, so a
# replica whose heartbeat is merely late keeps its entries.
SWEEP_GRACE_S = 30.0
# The event stream the gateways' local indexes follow (local_feed.py), and its approximate length cap: at
# ~10 batches a second per engine that is 5 s of history for 1,000 engines; a gateway further behind
# misses entries, sees the jump in the engine's sequence number and re-reads that engine (a resync).
EVENTS_STREAM = "tessera:pfx-events"
SEQ_KEY = "tessera:pfx-seq"
STREAM_MAXLEN = 50_000

Op = tuple[str, int]


def block_key(block_hash: int) -> str:
    return f"{BLOCK_PREFIX}{block_hash}"


def engine_blocks_key(engine_id: str) -> str:
    return f"{ENGINE_BLOCKS_PREFIX}{engine_id}"


# ARGV: engine id, op letters ('s'/'r'), the hashes packed (``pack_hashes``), the batch's publication time
# ('' = now), then the hashes in decimal. Besides the index keys, appends the batch to the event stream
# with the engine's next sequence number (see the module docstring).
_APPLY_LUA = """
local eid = ARGV[1]
local ops = ARGV[2]
local eset = 'tessera:pfx-engine:' .. eid
for i = 1, #ops do
  local h = ARGV[i + 4]
  local key = 'tessera:pfx:' .. h
  if string.sub(ops, i, i) == 's' then
    redis.call('HINCRBY', key, eid, 1)
    redis.call('SADD', eset, h)
  else
    local n = redis.call('HINCRBY', key, eid, -1)
    if n <= 0 then
      redis.call('HDEL', key, eid)
      redis.call('SREM', eset, h)
    end
  end
end
local now = redis.call('TIME')
redis.call('ZADD', 'tessera:pfx-engines', tonumber(now[1]), eid)
local ts = ARGV[4]
if ts == '' then ts = now[1] .. '.' .. string.format('%06d', tonumber(now[2])) end
local seq = redis.call('HINCRBY', 'tessera:pfx-seq', eid, 1)
redis.call('XADD', 'tessera:pfx-events', 'MAXLEN', '~', '@MAXLEN@', '*',
           'e', eid, 'n', seq, 't', ts, 'o', ops, 'h', ARGV[3])
return 1
""".replace("@MAXLEN@", str(STREAM_MAXLEN))

# ARGV: engine id, chunk size, grace seconds (negative: no grace check). Drops up to a chunk of the
# engine's blocks; returns how many remain (0 = done), or -1 when the engine applied a batch within the
# grace period (it is alive after all: keep its entries). The last chunk appends a clear ('c') to the
# event stream: a local index that snapshots the engine mid-clear still applies it afterwards.
_CLEAR_LUA = """
local eid = ARGV[1]
local grace = tonumber(ARGV[3])
if grace >= 0 then
  local last = redis.call('ZSCORE', 'tessera:pfx-engines', eid)
  if last and tonumber(last) > tonumber(redis.call('TIME')[1]) - grace then return -1 end
end
local eset = 'tessera:pfx-engine:' .. eid
local hashes = redis.call('SPOP', eset, tonumber(ARGV[2]))
for _, h in ipairs(hashes) do redis.call('HDEL', 'tessera:pfx:' .. h, eid) end
local left = redis.call('SCARD', eset)
if left == 0 then
  redis.call('ZREM', 'tessera:pfx-engines', eid)
  local now = redis.call('TIME')
  local seq = redis.call('HINCRBY', 'tessera:pfx-seq', eid, 1)
  redis.call('XADD', 'tessera:pfx-events', 'MAXLEN', '~', '@MAXLEN@', '*', 'e', eid, 'n', seq,
             't', now[1] .. '.' .. string.format('%06d', tonumber(now[2])), 'o', 'c', 'h', '')
end
return left
""".replace("@MAXLEN@", str(STREAM_MAXLEN))

# One engine's claims and its sequence number, atomically: a local index loads the hashes, then applies
# the engine's stream entries numbered above that sequence number (local_feed.py).
_SNAPSHOT_LUA = """
local seq = redis.call('HGET', 'tessera:pfx-seq', ARGV[1]) or '0'
return {seq, redis.call('SMEMBERS', 'tessera:pfx-engine:' .. ARGV[1])}
"""

_LOOKUP_LUA = """
local n = tonumber(ARGV[1])
local depth = {}
for i = 2, n + 1 do depth[ARGV[i]] = 0 end
for j = n + 2, #ARGV do
  local level = j - n - 1
  local holders = redis.call('HKEYS', 'tessera:pfx:' .. ARGV[j])
  local advanced = false
  for _, id in ipairs(holders) do
    if depth[id] == level - 1 then depth[id] = level; advanced = true end
  end
  if not advanced then break end
end
local out = {}
for id, d in pairs(depth) do if d > 0 then table.insert(out, id); table.insert(out, d) end end
return out
"""


def _encode(engine_id: str, ops: Sequence[Op], ts: float | None) -> list[str | bytes]:
    letters = []
    for op, _ in ops:
        if op not in ("store", "remove"):
            raise ValueError(f"unknown index op {op!r}; valid: store, remove, clear")
        letters.append("s" if op == "store" else "r")
    hashes = [h for _, h in ops]
    return [engine_id, "".join(letters), pack_hashes(hashes), "" if ts is None else repr(ts), *map(str, hashes)]


def pack_hashes(hashes: Sequence[int]) -> bytes:
    """Hashes as the event stream carries them: 8 bytes each, little-endian (``unpack_hashes``)."""
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack_hashes(packed: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(packed) // 8}Q", packed)


class PrefixIndex:
    """The Redis adapter. Engines write (``apply``), gateways read (``longest_prefixes``)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._apply = redis.register_script(_APPLY_LUA)
        self._clear = redis.register_script(_CLEAR_LUA)
        self._lookup = redis.register_script(_LOOKUP_LUA)
        self._snapshot = redis.register_script(_SNAPSHOT_LUA)

    async def longest_prefixes(self, chain: Sequence[int], engine_ids: Sequence[str]) -> dict[str, int]:
        """engine_id -> number of leading blocks of ``chain`` it holds, for the given (live) engines;
        engines holding none are left out."""
        if not chain or not engine_ids:
            return {}
        return await self.lookup(self.lookup_args(chain, engine_ids))

    async def lookup(self, args: Sequence[str | int]) -> dict[str, int]:
        """``longest_prefixes`` with its script arguments already built (see ``lookup_args``)."""
        return self.parse_lookup(await self._lookup(keys=[], args=list(args)))

    # The lookup in pieces, for a caller that sends it in one round trip with other commands:
    # ``EVALSHA lookup_sha 0 *lookup_args(...)``, then ``parse_lookup`` on its reply.
    @property
    def lookup_sha(self) -> str:
        return str(self._lookup.sha)

    @staticmethod
    def lookup_args(chain: Sequence[int], engine_ids: Sequence[str]) -> list[str | int]:
        return [len(engine_ids), *engine_ids, *chain]

    @staticmethod
    def parse_lookup(flat: Sequence[Any]) -> dict[str, int]:
        return {_text(flat[i]): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def apply(self, engine_id: str, ops: Sequence[Op], ts: float | None = None) -> None:
        """Applies an engine's events in order: ("store", h), ("remove", h) or ("clear", 0). ``ts``: when the
        engine published them (Unix seconds; default: now), which the local indexes' lag is measured from."""
        start = 0
        for i, (op, _) in enumerate(ops):
            if op == "clear":
                await self._apply_run(engine_id, ops[start:i], ts)
                await self.clear_engine(engine_id)
                start = i + 1
        await self._apply_run(engine_id, ops[start:], ts)

    async def _apply_run(self, engine_id: str, ops: Sequence[Op], ts: float | None) -> None:
        if ops:
            await self._apply(keys=[], args=_encode(engine_id, ops, ts))

    async def snapshot(self, engine_id: str) -> tuple[int, list[int]]:
        """The engine's sequence number and the hashes it holds, read atomically (local indexes' warm start
        and resync)."""
        seq, members = await self._snapshot(keys=[], args=[engine_id])
        return int(seq), [int(h) for h in members]

    async def clear_engine(self, engine_id: str) -> None:
        """Forgets every block of the engine (AllBlocksCleared, a gap in its events, or a clean shutdown)."""
        await self._clear_chunks(engine_id, grace_s=-1.0)

    async def _clear_chunks(self, engine_id: str, grace_s: float) -> bool:
        while True:
            left = int(await self._clear(keys=[], args=[engine_id, CLEAR_CHUNK, grace_s]))
            if left <= 0:
                return left == 0

    async def sweep(self, live_engine_ids: Iterable[str], grace_s: float | None = None) -> list[str]:
        """Drops the entries of engines that are not live and have applied nothing for ``grace_s``
        (default ``SWEEP_GRACE_S``); returns the engines swept. Idempotent: gateways and engines may sweep
        at the same time."""
        grace_s = SWEEP_GRACE_S if grace_s is None else grace_s
        live = set(live_engine_ids)
        swept = []
        for engine_id in await self.indexed_engines():
            if engine_id not in live and await self._clear_chunks(engine_id, grace_s):
                swept.append(engine_id)
        return swept

    async def blocks_of(self, engine_id: str) -> dict[int, int]:
        """hash -> copies, for every block the index says the engine holds (tests and debugging)."""
        hashes = [int(h) for h in await self._redis.smembers(engine_blocks_key(engine_id))]
        if not hashes:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for h in hashes:
            pipe.hget(block_key(h), engine_id)
        counts = await pipe.execute()
        return {h: int(c) for h, c in zip(hashes, counts, strict=True) if c is not None}

    async def indexed_engines(self) -> list[str]:
        """Engines with entries in the index (oldest last batch first)."""
        return [_text(raw) for raw in await self._redis.zrange(ENGINES_KEY, 0, -1)]


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
