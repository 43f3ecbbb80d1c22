"""One blocking ``XREAD`` on a pooled connection, with a read timeout that covers its block.

The gateway's Redis client times every reply out after ``TESSERA_REDIS_TIMEOUT_S`` (0.25 s by default), so a
request fails fast when Redis is down. A blocking ``XREAD`` through that client could therefore wait less than
the timeout, and a feed that follows a quiet stream asked twenty times a second (a 50 ms block): each read is
a round trip through ``redis.asyncio``, about 8-10 ms/s of a gateway worker's CPU and 3 ms/s of Redis's for the
ten seconds after every route (``make bench-gateway-cpu --prompt-tokens 350``, "idle right after traffic").
Here the read takes a connection from the same pool (a Sentinel pool follows failover as the client does) and
waits for its reply ``block_ms`` plus the connection's own timeout. The block costs no freshness: Redis answers
as soon as an entry arrives. A read that fails or is cancelled goes with its connection (redis-py's
``read_response`` disconnects on any exception), so a late reply never reaches the pool's next user: the feed's
``stop`` cancels its read instead of waiting out the block
(tests/integration/routing/test_local_index_feed.py).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis

# An entry: its id and its fields (bytes -> bytes).
StreamEntry = tuple[bytes, dict[bytes, bytes]]


async def read_stream(redis: aioredis.Redis, stream: str, last_id: bytes | str, count: int,
                      block_ms: int) -> list[StreamEntry]:
    """The entries of ``stream`` after ``last_id`` (at most ``count``), waiting up to ``block_ms`` for one;
    [] when none came. Raises redis-py's errors (a timeout: no reply within the block and the socket timeout)."""
    pool = redis.connection_pool
    conn = await pool.get_connection()
    try:
        await conn.send_command("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", stream, last_id)
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
