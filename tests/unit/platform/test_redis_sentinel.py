"""``redis+sentinel://`` URLs, and the lean connection following the primary the Sentinels name.

The servers here are fakes that speak just enough RESP (a Sentinel answering GET-MASTER-ADDR-BY-NAME, data
servers answering ROLE, GET and SET), so each defence is held to one exact behaviour in milliseconds; the
real thing, valkey-server Sentinels promoting a replica under a gateway's load, is
tests/integration/tenancy/test_redis_sentinel_failover.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import hiredis
import pytest
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError

from tessera.redis_conn import connect
from tessera.redis_sentinel import SentinelConfig, SentinelResolver, parse_sentinel_url
from tessera.redis_wire import RedisWire
from tests.support.machine import free_port


def test_a_full_url_parses_into_its_parts() -> None:
    config = parse_sentinel_url("redis+sentinel://app:s%40cret@s1:26380,s2,[::1]:26381/tessera/3")
    assert config == SentinelConfig(sentinels=(("s1", 26380), ("s2", 26379), ("::1", 26381)),
                                    primary_name="tessera", db=3, username="app", password="s@cret",
                                    sentinel_password="s@cret")


def test_defaults_no_credentials_and_database_zero() -> None:
    config = parse_sentinel_url("redis+sentinel://sentinel:26379/mymaster")
    assert (config.db, config.username, config.password, config.sentinel_password) == (0, None, None, None)
    assert config.sentinel_auth() == {}


def test_the_sentinels_may_have_their_own_password_or_none() -> None:
    own = parse_sentinel_url("redis+sentinel://:data@h1/p?sentinel_password=sent")
    assert (own.password, own.sentinel_password) == ("data", "sent")
    none = parse_sentinel_url("redis+sentinel://:data@h1/p?sentinel_password=")
    assert (none.password, none.sentinel_password) == ("data", None)


@pytest.mark.parametrize(("url", "complaint"), [
    ("redis://h1:6379/0", "starts with redis+sentinel://"),
    ("redis+sentinel:///tessera", "at least one Sentinel"),
    ("redis+sentinel://h1:26379", "/<primary-name>[/db]"),
    ("redis+sentinel://h1:26379/tessera/0/x", "/<primary-name>[/db]"),
    ("redis+sentinel://h1:26379/tessera/zero", "must be a number"),
    ("redis+sentinel://h1:port/tessera", "port must be a number"),
    ("redis+sentinel://h1/tessera?ssl=true", "valid: ['sentinel_password']"),
])
def test_a_wrong_url_says_what_is_wrong(url: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=None) as raised:
        parse_sentinel_url(url)
    assert complaint in str(raised.value)


def test_the_config_is_strict() -> None:
    with pytest.raises(ValidationError):
        SentinelConfig(sentinels=(("h", 1),), primary_name="p", tls=True)  # type: ignore[call-arg]


def test_a_redis_py_client_of_a_sentinel_url_keeps_the_bounded_waiting_pool() -> None:
    client = connect("redis+sentinel://:pw@127.0.0.1:1/tessera/2", timeout_s=0.3, pool_size=7)
    pool: Any = client.connection_pool
    assert (pool.service_name, pool.max_connections, pool.timeout) == ("tessera", 7, 0.3)
    assert (pool.connection_kwargs["db"], pool.connection_kwargs["password"]) == (2, "pw")
    assert pool.connection_kwargs["socket_timeout"] == 0.3


def _resp(value: Any) -> bytes:
    if isinstance(value, Exception):
        return b"-%s\r\n" % str(value).encode()
    if value is None:
        return b"*-1\r\n"
    if isinstance(value, int):
        return b":%d\r\n" % value
    if isinstance(value, list):
        return b"*%d\r\n" % len(value) + b"".join(_resp(v) for v in value)
    data = value if isinstance(value, bytes) else str(value).encode()
    return b"$%d\r\n%s\r\n" % (len(data), data)


class FakeServer:
    """A TCP server answering each RESP command with ``handler(command)``; it records what it was sent."""

    def __init__(self, handler: Callable[[list[bytes]], Any]) -> None:
        self.handler = handler
        self.commands: list[list[bytes]] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> FakeServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.append(writer)
        parser = hiredis.Reader()
        try:
            while data := await reader.read(4096):
                parser.feed(data)
                while (command := parser.gets()) is not False:
                    self.commands.append(command)
                    writer.write(_resp(self.handler(command)))
        except ConnectionError:
            pass
        finally:
            writer.close()

    def drop_clients(self) -> None:
        """As a killed server: every open connection closes."""
        for writer in self._writers:
            writer.close()
        self._writers.clear()

    async def close(self) -> None:
        self.drop_clients()
        if self._server is not None:
            self._server.close()


class FakeData:
    """A data server: ``role`` is "master" or "slave"; a replica refuses writes with READONLY."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.role = "master"
        self.cut_off = False  # min-replicas-to-write not met
        self.server = FakeServer(self.answer)

    def answer(self, command: list[bytes]) -> Any:
        verb = command[0].upper()
        if verb == b"AUTH":
            return b"OK" if command[-1] == b"pw" else Exception("WRONGPASS invalid password")
        if verb == b"ROLE":
            return [self.role.encode(), 0, []]
        if verb == b"SET" and self.role != "master":
            return Exception("READONLY You can't write against a read only replica.")
        if verb == b"SET" and self.cut_off:
            return Exception("NOREPLICAS Not enough good replicas to write.")
        return self.name.encode()

    def sent(self, verb: bytes) -> int:
        return sum(1 for c in self.server.commands if c[0].upper() == verb)


class FakeSentinel:
    """Names ``primary`` (a FakeData) and wants ``password`` first when set."""

    def __init__(self, password: str | None = None) -> None:
        self.primary: FakeData | None = None
        self.password = password
        self.server = FakeServer(self.answer)

    def answer(self, command: list[bytes]) -> Any:
        if command[0].upper() == b"AUTH":
            return b"OK" if self.password and command[-1] == self.password.encode() else Exception("WRONGPASS")
        assert [c.upper() for c in command[:2]] == [b"SENTINEL", b"GET-MASTER-ADDR-BY-NAME"], command
        if command[2] != b"tessera" or self.primary is None:
            return None
        return [b"127.0.0.1", str(self.primary.server.port).encode()]


@pytest.fixture
async def cluster() -> AsyncIterator[tuple[FakeSentinel, FakeData, FakeData]]:
    sentinel, a, b = FakeSentinel(), FakeData("a"), FakeData("b")
    for server in (sentinel.server, a.server, b.server):
        await server.start()
    b.role = "slave"
    sentinel.primary = a
    yield sentinel, a, b
    for server in (sentinel.server, a.server, b.server):
        await server.close()


def _url(*sentinels: FakeSentinel | int) -> str:
    hosts = ",".join(f"127.0.0.1:{s if isinstance(s, int) else s.server.port}" for s in sentinels)
    return f"redis+sentinel://:pw@{hosts}/tessera?sentinel_password="


async def _wait_lost(wire: RedisWire) -> None:
    for _ in range(200):
        protocol = wire._protocol
        if protocol is None or protocol.lost is not None:
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the wire never noticed its connection closing")


async def test_after_a_failover_the_wire_connects_to_the_new_primary(
        cluster: tuple[FakeSentinel, FakeData, FakeData]) -> None:
    sentinel, a, b = cluster
    wire = RedisWire(_url(sentinel), timeout_s=1.0)
    assert await wire.execute([("GET", "k")]) == [b"a"]
    # The failover: a dies, the Sentinels promote b.
    sentinel.primary, b.role = b, "master"
    a.server.drop_clients()
    await _wait_lost(wire)
    assert await wire.execute([("GET", "k")]) == [b"b"]
    assert a.sent(b"AUTH") == b.sent(b"AUTH") == 1  # each connection authenticated once
    await wire.close()


async def test_a_server_that_is_not_yet_the_primary_gets_no_command(
        cluster: tuple[FakeSentinel, FakeData, FakeData]) -> None:
    sentinel, _, b = cluster
    sentinel.primary = b  # a Sentinel names b before b has taken the role
    wire = RedisWire(_url(sentinel), timeout_s=1.0)
    with pytest.raises(RedisConnectionError, match="is a slave, not the primary"):
        await wire.execute([("SET", "k", "v")])
    assert b.sent(b"ROLE") == 1 and b.sent(b"SET") == 0
    b.role = "master"  # promoted: the next call goes through
    assert await wire.execute([("SET", "k", "v")]) == [b"b"]
    await wire.close()


async def test_readonly_fails_the_call_and_the_next_call_asks_the_sentinels_again(
        cluster: tuple[FakeSentinel, FakeData, FakeData]) -> None:
    sentinel, a, b = cluster
    wire = RedisWire(_url(sentinel), timeout_s=1.0)
    assert await wire.execute([("GET", "k")]) == [b"a"]
    # a is demoted under the open connection (a partition healed; the Sentinels made it a replica of b).
    a.role, b.role, sentinel.primary = "slave", "master", b
    with pytest.raises(RedisConnectionError, match="not a primary that takes writes: READONLY"):
        await wire.execute([("SET", "k", "v"), ("GET", "k")])
    assert await wire.execute([("SET", "k", "v")]) == [b"b"]
    assert a.sent(b"SET") == 1, "nothing retried on the demoted server"
    await wire.close()


async def test_a_primary_without_its_replicas_fails_the_call_and_the_next_asks_again(
        cluster: tuple[FakeSentinel, FakeData, FakeData]) -> None:
    sentinel, a, b = cluster
    wire = RedisWire(_url(sentinel), timeout_s=1.0)
    assert await wire.execute([("GET", "k")]) == [b"a"]
    # b was promoted in a's place; a has not heard yet, but has lost its replica (min-replicas-to-write).
    a.cut_off, b.role, sentinel.primary = True, "master", b
    # A connection error, not a ResponseError in its place: the gateway answers 503 (a 500 otherwise), a
    # finish is parked, as when Redis is down.
    with pytest.raises(RedisConnectionError, match="NOREPLICAS"):
        await wire.execute([("SET", "k", "v"), ("GET", "k")])
    assert await wire.execute([("SET", "k", "v")]) == [b"b"]
    await wire.close()


async def test_a_dead_sentinel_is_skipped_and_the_one_that_answered_is_asked_first() -> None:
    sentinel, a = FakeSentinel(password="spw"), FakeData("a")
    await sentinel.server.start()
    await a.server.start()
    sentinel.primary = a
    dead = free_port()
    config = parse_sentinel_url(f"redis+sentinel://:pw@127.0.0.1:{dead},127.0.0.1:{sentinel.server.port}/tessera"
                                f"?sentinel_password=spw")
    resolver = SentinelResolver(config, timeout_s=1.0)
    assert await resolver.primary_address() == ("127.0.0.1", a.server.port)
    assert await resolver.primary_address() == ("127.0.0.1", a.server.port)
    assert [c[0] for c in sentinel.server.commands] == [b"AUTH", b"SENTINEL"] * 2
    assert resolver._order[0] == ("127.0.0.1", sentinel.server.port)
    sentinel.primary = None
    with pytest.raises(RedisConnectionError, match=f"does not monitor 'tessera'; 127.0.0.1:{dead}: "):
        await resolver.primary_address()
    await sentinel.server.close()
    await a.server.close()
