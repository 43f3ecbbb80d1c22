"""RedisWire, the gateway's lean request-path connection, against a real Valkey: the same replies as
redis-py, error replies in place, concurrent callers each get their own replies, and a timeout, a
cancelled caller or a restarted server never hands one caller another's reply."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.redis_wire import RedisWire
from tessera.resp import Command
from tessera.wake_grid import GRID_S, until_next

SCRIPT = "return {KEYS[1], tonumber(ARGV[1]) + 1, redis.call('EXISTS', KEYS[1])}"


@pytest.fixture
async def client(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    redis = connect(redis_server.url, timeout_s=5.0)
    yield redis
    await redis.aclose()


async def test_replies_match_redis_py(redis_server: EmbeddedRedis, client: aioredis.Redis) -> None:
    key = f"wire-{uuid.uuid4().hex}"
    await client.hset(key, mapping={"a": "1", "b": "two"})
    sha = await client.script_load(SCRIPT)
    wire = RedisWire(redis_server.url, timeout_s=2.0)
    replies = await wire.execute([("HGETALL", key), ("EXISTS", key), ("GET", f"{key}-missing"),
                                  ("EVALSHA", sha, 1, key, 41), ("INCRBY", f"{key}-n", 5)])
    pipe = client.pipeline(transaction=False)
    pipe.execute_command("HGETALL", key)  # raw, as the wire returns it (no response callback)
    pipe.exists(key).get(f"{key}-missing").evalsha(sha, 1, key, 41).incrby(f"{key}-n", 5)
    expected = await pipe.execute()
    assert replies[0] == [b"a", b"1", b"b", b"two"] and expected[0] in ({b"a": b"1", b"b": b"two"}, replies[0])
    assert replies[1:4] == expected[1:4] == [1, None, [key.encode(), 42, 1]]
    assert (replies[4], expected[4]) == (5, 10)  # both incremented the same counter
    await wire.close()


async def test_error_replies_come_back_in_place(redis_server: EmbeddedRedis, client: aioredis.Redis) -> None:
    key = f"wire-{uuid.uuid4().hex}"
    await client.set(key, "text")
    wire = RedisWire(redis_server.url, timeout_s=2.0)
    replies = await wire.execute([("EVALSHA", "0" * 40, 0), ("INCR", key), ("GET", key)])
    assert isinstance(replies[0], NoScriptError)  # what the gateway's NOSCRIPT fallback looks for
    assert isinstance(replies[1], ResponseError) and not isinstance(replies[1], NoScriptError)
    assert "not an integer" in str(replies[1])
    assert replies[2] == b"text"
    await wire.close()


async def test_concurrent_callers_each_get_their_own_replies(redis_server: EmbeddedRedis,
                                                             client: aioredis.Redis) -> None:
    prefix = f"wire-{uuid.uuid4().hex}"
    await client.mset({f"{prefix}-{i}": str(i) for i in range(300)})
    wire = RedisWire(redis_server.url, timeout_s=5.0)

    async def read(i: int) -> list[object]:
        return await wire.execute([("GET", f"{prefix}-{i}"), ("STRLEN", f"{prefix}-{i}")])

    results = await asyncio.gather(*(read(i) for i in range(300)))
    assert results == [[str(i).encode(), len(str(i))] for i in range(300)]
    await wire.close()


async def test_a_timeout_drops_the_connection_and_no_late_reply_reaches_the_next_caller(
        redis_server: EmbeddedRedis, client: aioredis.Redis) -> None:
    key = f"wire-{uuid.uuid4().hex}"
    await client.mset({f"{key}-a": "a", f"{key}-b": "b"})
    wire = RedisWire(redis_server.url, timeout_s=0.2)
    assert await wire.execute([("GET", f"{key}-a")]) == [b"a"]
    pauser = connect(redis_server.url, timeout_s=5.0)
    await pauser.execute_command("CLIENT", "PAUSE", 600, "ALL")
    with pytest.raises(RedisTimeoutError, match=r"did not answer within 0\.2 s"):
        await wire.execute([("GET", f"{key}-a")])
    await asyncio.sleep(0.6)  # the pause ends; the late reply to the timed-out GET went to a dropped connection
    assert await wire.execute([("GET", f"{key}-b")]) == [b"b"]
    await pauser.aclose()
    await wire.close()


async def test_a_cancelled_caller_leaves_the_replies_aligned(redis_server: EmbeddedRedis,
                                                             client: aioredis.Redis) -> None:
    key = f"wire-{uuid.uuid4().hex}"
    await client.mset({f"{key}-a": "a", f"{key}-b": "b"})
    wire = RedisWire(redis_server.url, timeout_s=2.0)
    cancelled = asyncio.ensure_future(wire.execute([("GET", f"{key}-a"), ("GET", f"{key}-a")]))
    await asyncio.sleep(0)  # sent
    cancelled.cancel()
    assert await wire.execute([("GET", f"{key}-b")]) == [b"b"]
    assert cancelled.cancelled()
    await wire.close()


async def test_a_restarted_server_fails_calls_then_serves_again() -> None:
    server = EmbeddedRedis().start()
    port = server.port
    wire = RedisWire(server.url, timeout_s=1.0)
    assert await wire.execute([("SET", "k", "v"), ("GET", "k")]) == [b"OK", b"v"]
    server.stop()
    with pytest.raises(RedisConnectionError):
        await wire.execute([("GET", "k")])
    with pytest.raises(RedisConnectionError, match="could not connect"):
        await wire.execute([("GET", "k")])  # refused while it is down
    server = EmbeddedRedis(port=port).start()
    try:
        assert await wire.execute([("SET", "k", "again"), ("GET", "k")]) == [b"OK", b"again"]
    finally:
        await wire.close()
        server.stop()


async def test_password_and_database_from_the_url() -> None:
    server = EmbeddedRedis(password="s3cret").start()
    try:
        url = server.url.rsplit("/", 1)[0] + "/3"
        wire = RedisWire(url, timeout_s=1.0)
        await wire.execute([("SET", "in-db-3", "yes")])
        reader = connect(url, timeout_s=1.0)
        assert await reader.get("in-db-3") == b"yes"
        other_db = connect(server.url, timeout_s=1.0)
        assert await other_db.get("in-db-3") is None
        await reader.aclose()
        await other_db.aclose()
        await wire.close()
        wrong = RedisWire(url.replace("s3cret", "wrong"), timeout_s=1.0)
        with pytest.raises(RedisConnectionError, match="refused the connection set-up"):
            await wrong.execute([("PING",)])
    finally:
        server.stop()


async def _held_within_a_second(wire: RedisWire, commands: list[Command]) -> asyncio.Future[list[Any]]:
    """Sends ``commands`` unhurried 10 ms after a whole second and waits 0.2 s: the reply, if it came meanwhile,
    came on its own, not at the grid's next second. Tries again where a stalled loop (a loaded machine) let that
    second pass before the check."""
    for _ in range(5):
        await asyncio.sleep(until_next(GRID_S) + 0.01)
        next_second = time.monotonic() + until_next(GRID_S)
        held = await wire.send_unhurried(commands)
        await asyncio.sleep(0.2)
        if time.monotonic() < next_second - 0.05:
            return held
        await held
    raise AssertionError("the event loop never ran within a second here: the check cannot be made")


async def test_an_unhurried_reply_waits_for_the_next_callers_and_comes_first(
        redis_server: EmbeddedRedis, client: aioredis.Redis) -> None:
    """Redis runs an unhurried call on receipt, but its reply is not read on its own (no wake-up for it): it is
    read with the next caller's, in order."""
    key = f"wire-{uuid.uuid4().hex}"
    wire = RedisWire(redis_server.url, timeout_s=2.0)
    await wire.execute([("PING",)])
    held = await _held_within_a_second(wire, [("SET", key, "1"), ("INCR", key)])
    assert await client.get(key) == b"2"  # applied...
    assert not held.done()  # ...its reply not read: the connection stopped reading
    assert await wire.execute([("INCR", key)]) == [3]
    assert held.done() and held.result() == [b"OK", 2]
    await wire.close()


async def test_an_unhurried_reply_is_read_by_the_next_whole_second(redis_server: EmbeddedRedis) -> None:
    key = f"wire-{uuid.uuid4().hex}"
    wire = RedisWire(redis_server.url, timeout_s=2.0)
    await wire.execute([("PING",)])
    held = await _held_within_a_second(wire, [("SET", key, "1")])
    assert not held.done()
    assert await asyncio.wait_for(held, GRID_S) == [b"OK"]  # at the second, with nobody else calling
    # An error reply comes back in its place, as ``execute`` returns it.
    failed = await wire.send_unhurried([("EVALSHA", "0" * 40, 0)])
    wire.read_replies()
    (reply,) = await asyncio.wait_for(failed, 1.0)
    assert isinstance(reply, NoScriptError)
    await wire.close()


async def test_a_connection_lost_while_replies_are_held_fails_them_and_the_next_call_reconnects(
        redis_server: EmbeddedRedis, client: aioredis.Redis) -> None:
    key = f"wire-{uuid.uuid4().hex}"
    wire = RedisWire(redis_server.url, timeout_s=2.0)
    await wire.execute([("CLIENT", "SETNAME", key)])
    held = await wire.send_unhurried([("BLPOP", f"{key}-empty", 0)])  # no reply until the list gets an item
    clients = await client.client_list()
    await client.client_kill_filter(_id=next(c["id"] for c in clients if c.get("name") == key))
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(held, GRID_S + 1.0)  # seen when reading resumes, at the latest at the second
    assert await wire.execute([("INCR", key)]) == [1]
    await wire.close()
