"""One blocking ``XREAD``, with a reply timeout that covers its block.

The gateway's Redis clients time every reply out after ``TESSERA_REDIS_TIMEOUT_S`` (0.25 s by default), so a
request fails fast when Redis is down. A blocking ``XREAD`` under that timeout could wait less than it, and the
local index's feed asked a quiet stream twenty times a second (a 50 ms block): each read a round trip through
``redis.asyncio``, 7-10 ms/s of a gateway worker's CPU for the ten seconds after every route (``make
bench-gateway-cpu --prompt-tokens 350``, "idle right after traffic"). Here the read's reply may take the block
plus the client's own timeout. The block costs no freshness: Redis answers as soon as an entry arrives.

Two transports, the same reply:
- a ``RedisWire`` of the reader's own (the gateway's): the lean connection, ~180 against ~370 us of CPU a read
  that finds an entry waiting (in process, an avx512/AMX VM, 40 ms apart), which every gateway worker pays on
  each batch an engine publishes. Its own, because a blocking read holds up every call behind it on the wire.
  A cancelled read closes the wire's connection (the next call opens another), so no late reply is left on it;
- a redis-py client (tests, benches, tools): a connection from its pool (a Sentinel pool follows failover),
  which redis-py drops when its read fails or is cancelled (``read_response`` disconnects on any exception).
"""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from tessera.redis_wire import RedisWire

# An entry: its id and its fields (bytes -> bytes).
StreamEntry = tuple[bytes, dict[bytes, bytes]]


async def read_stream(source: RedisWire | aioredis.Redis, stream: str, last_id: bytes | str, count: int,
                      block_ms: int) -> list[StreamEntry]:
    """The entries of ``stream`` after ``last_id`` (at most ``count``), waiting up to ``block_ms`` for one (0:
    not at all, where Redis's ``BLOCK 0`` would wait for ever); [] when none came. Raises redis-py's errors (a
    timeout: no reply within the block and the client's timeout)."""
    block: tuple[str | int, ...] = ("BLOCK", block_ms) if block_ms > 0 else ()
    command = ("XREAD", "COUNT", count, *block, "STREAMS", stream, last_id)
    if isinstance(source, RedisWire):
        try:
            (reply,) = await source.execute([command], timeout_s=block_ms / 1000 + source.timeout_s)
        except asyncio.CancelledError:
            await source.close()
            raise
        if isinstance(reply, Exception):
            raise reply
        return stream_entries(reply)
    pool = source.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_command(*command)
        reply = await conn.read_response(timeout=block_ms / 1000 + (conn.socket_timeout or 0.0))
    finally:
        await pool.release(conn)
    return stream_entries(reply)


def stream_entries(reply: Any) -> list[StreamEntry]:
    """An ``XREAD`` reply of one stream as its entries: RESP2's ``[[name, [[id, [f, v, ...]], ...]]]`` or
    RESP3's ``{name: [[id, [f, v, ...]], ...]}``; None (the block ran out) as []."""
    if not reply:
        return []
    streams = list(reply.values()) if isinstance(reply, dict) else [entries for _, entries in reply]
    result: list[StreamEntry] = []
    for entries in streams:
        for entry_id, flat in entries:
            fields = iter(flat or ())
            result.append((entry_id, dict(zip(fields, fields, strict=True))))
    return result
