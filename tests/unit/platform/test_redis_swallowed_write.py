"""A cancellation that redis-py's write swallowed is raised where it was lost (swallowed_cancel.py,
redis_conn.connect): beside a real Redis, with Python 3.11's real ``wait_for`` around the write, the task is
cancelled as the write completes. Without the mend the command returns its reply and the task goes on,
cancelled in name only."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
import redis.asyncio as aioredis

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.swallowed_cancel import (
    HonouringConnection,
    HonouringSSLConnection,
    HonouringUnixDomainSocketConnection,
)
from tests.support.swallowed_cancel import write_cancelling


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = EmbeddedRedis().start()
    yield server.url
    server.stop()


async def _set_in_a_task(client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch, key: str) -> asyncio.Task[object]:
    task: asyncio.Task[object] | None = None
    write_cancelling(monkeypatch, lambda: task)

    async def sets() -> object:
        return await client.set(key, "written")

    task = asyncio.create_task(sets())
    await asyncio.wait({task}, timeout=10)
    monkeypatch.undo()
    return task


async def test_a_command_whose_write_swallowed_its_cancellation_raises_it(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = connect(redis_url, timeout_s=5.0)
    try:
        task = await _set_in_a_task(client, monkeypatch, "swallowed:raised")
        assert task.done()
        assert task.cancelled(), f"the command returned {task.result()!r}: its cancellation was swallowed"
        # Whether Redis ran it is not known (the connection closed right after the write), as for any command
        # cancelled before its reply: the client goes on with the next command on a sound connection.
        assert await client.get("swallowed:raised") in (None, b"written")
    finally:
        await client.aclose()


async def test_the_next_command_on_the_pool_reads_its_own_reply(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cancelled command's reply is never read: its connection is dropped, not handed to the next command
    (one connection in the pool, so the next command would get it). Redis holds the cancelled write's reply back
    (``CLIENT PAUSE ... WRITE``), so the pool's own check for a connection with unread data finds none yet, and
    the next command, a read that Redis answers at once on a fresh connection, would read ``OK`` on the old."""
    client, admin = connect(redis_url, timeout_s=5.0, pool_size=1), connect(redis_url, timeout_s=5.0)
    try:
        await client.set("swallowed:other", "its own")
        await admin.execute_command("CLIENT", "PAUSE", 500, "WRITE")
        task = await _set_in_a_task(client, monkeypatch, "swallowed:next")
        assert task.cancelled()
        assert await client.get("swallowed:other") == b"its own"
        await admin.execute_command("CLIENT", "UNPAUSE")
        assert await client.get("swallowed:other") == b"its own"
    finally:
        await admin.execute_command("CLIENT", "UNPAUSE")
        await admin.aclose()
        await client.aclose()


async def test_cleanup_under_a_cancellation_still_writes(redis_url: str) -> None:
    """Cleanup that runs under its task's cancellation on purpose (a last flush, a deregistration) starts with
    the count raised: its commands go through."""
    client = connect(redis_url, timeout_s=5.0)
    started = asyncio.Event()

    async def flushes_on_the_way_out() -> None:
        try:
            started.set()
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            await client.set("swallowed:cleanup", "flushed")
            await client.incr("swallowed:cleanups")
            raise

    try:
        task = asyncio.create_task(flushes_on_the_way_out())
        await started.wait()
        task.cancel()
        await asyncio.wait({task}, timeout=10)
        assert task.cancelled()
        assert await client.get("swallowed:cleanup") == b"flushed"
    finally:
        await client.aclose()


@pytest.mark.parametrize(("url", "honouring"), [
    ("redis://127.0.0.1:1/0", HonouringConnection),
    ("rediss://127.0.0.1:1/0", HonouringSSLConnection),
    ("unix:///tmp/tessera-no-such.sock", HonouringUnixDomainSocketConnection),
])
async def test_every_scheme_gets_connections_that_raise_it(url: str, honouring: type) -> None:
    client = connect(url)
    try:
        assert client.connection_pool.connection_class is honouring
    finally:
        await client.aclose()
