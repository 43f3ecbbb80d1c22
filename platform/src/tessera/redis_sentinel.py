"""A Sentinel-managed Redis primary: its URL, and finding the primary through the Sentinels.

Every component takes one Redis URL (``TESSERA_REDIS_URL``). Besides ``redis://`` and ``rediss://``, a URL
may name Sentinels instead of a server::

    redis+sentinel://[[user]:password@]host1:26379,host2:26379,host3:26379/<primary-name>[/db]

The password (and user) authenticate to the data servers and, unless the query sets ``sentinel_password``
(empty: the Sentinels need none), to the Sentinels too, as the chart runs them. The redis-py clients
(``redis_conn.connect``) follow failover with ``redis.asyncio.sentinel``; the gateway's lean connection
(``redis_wire.RedisWire``) asks ``SENTINEL GET-MASTER-ADDR-BY-NAME`` itself each time it connects
(``SentinelResolver``) and checks ``ROLE`` before it sends anything (docs/kubernetes.md "Redis high
availability").
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import parse_qs, unquote

import hiredis
from pydantic import BaseModel, ConfigDict, Field
from redis.exceptions import ConnectionError as RedisConnectionError

from tessera.resp import pack_commands

SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379


class SentinelConfig(BaseModel):
    """A ``redis+sentinel://`` URL, parsed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sentinels: tuple[tuple[str, int], ...] = Field(
        min_length=1, description="(host, port) of each Sentinel, asked in this order.")
    primary_name: str = Field(min_length=1, description="The name the Sentinels monitor the primary under.")
    db: int = Field(default=0, ge=0, description="Database index on the data servers.")
    username: str | None = Field(default=None, description="ACL user on the data servers (and Sentinels).")
    password: str | None = Field(default=None, description="Password of the data servers.")
    sentinel_password: str | None = Field(
        default=None, description="Password of the Sentinels; None: none. The URL's own password unless the "
        "query sets sentinel_password.")

    def data_server_auth(self) -> dict[str, Any]:
        return {"username": self.username, "password": self.password}

    def sentinel_auth(self) -> dict[str, Any]:
        if self.sentinel_password is None:
            return {}
        return {"username": self.username, "password": self.sentinel_password}


def is_sentinel_url(url: str) -> bool:
    return url.startswith(f"{SENTINEL_SCHEME}://")


def parse_sentinel_url(url: str) -> SentinelConfig:
    """Raises ``ValueError`` saying what is wrong with the URL."""
    if not is_sentinel_url(url):
        raise ValueError(f"a Sentinel URL starts with {SENTINEL_SCHEME}://, got {url.split('://')[0]!r}")
    rest = url[len(SENTINEL_SCHEME) + 3:]
    rest, _, query = rest.partition("?")
    netloc, _, path = rest.partition("/")
    username = password = None
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, _, secret = userinfo.partition(":")
        username, password = unquote(user) or None, unquote(secret) or None
    sentinels = tuple(_host_port(part) for part in netloc.split(",") if part)
    if not sentinels:
        raise ValueError(f"a Sentinel URL names at least one Sentinel host: {_redacted(url)}")
    segments = [s for s in path.split("/") if s]
    if not segments or len(segments) > 2:
        raise ValueError(f"a Sentinel URL's path is /<primary-name>[/db]: {_redacted(url)}")
    if len(segments) == 2 and not segments[1].isdigit():
        raise ValueError(f"the database index must be a number, got {segments[1]!r}")
    options = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    unknown = set(options) - {"sentinel_password"}
    if unknown:
        raise ValueError(f"unknown Sentinel URL options {sorted(unknown)}; valid: ['sentinel_password']")
    sentinel_password = password
    if "sentinel_password" in options:
        sentinel_password = options["sentinel_password"] or None
    return SentinelConfig(sentinels=sentinels, primary_name=unquote(segments[0]),
                          db=int(segments[1]) if len(segments) == 2 else 0, username=username,
                          password=password, sentinel_password=sentinel_password)


def _host_port(part: str) -> tuple[str, int]:
    if part.startswith("["):  # [IPv6]:port
        host, _, port = part[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host:
        raise ValueError(f"a Sentinel address needs a host: {part!r}")
    if port and not port.isdigit():
        raise ValueError(f"a Sentinel port must be a number: {part!r}")
    return host, int(port) if port else DEFAULT_SENTINEL_PORT


def _redacted(url: str) -> str:
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rpartition('@')[2]}" if "@" in rest else url


def _pack(*args: str | int) -> bytes:
    return pack_commands([args])


class SentinelResolver:
    """The primary's address as the Sentinels give it (``SENTINEL GET-MASTER-ADDR-BY-NAME``), asked one
    Sentinel at a time in order; the first that answers moves to the front, so a dead Sentinel costs a
    timeout only until another has answered. Raises redis-py's ``ConnectionError`` when none knows the
    primary, so callers handle it as any unreachable Redis (503, a finish parked)."""

    def __init__(self, config: SentinelConfig, timeout_s: float) -> None:
        self.config = config
        self._timeout_s = timeout_s
        self._order = list(config.sentinels)

    async def primary_address(self) -> tuple[str, int]:
        problems: list[str] = []
        for index, (host, port) in enumerate(self._order):
            try:
                async with asyncio.timeout(self._timeout_s):
                    address = await self._ask(host, port)
            except (OSError, TimeoutError, ConnectionError) as exc:
                problems.append(f"{host}:{port}: {exc or type(exc).__name__}")
                continue
            if address is None:
                problems.append(f"{host}:{port}: does not monitor {self.config.primary_name!r}")
                continue
            if index:
                self._order.insert(0, self._order.pop(index))
            return address
        raise RedisConnectionError(f"no Sentinel gave the primary {self.config.primary_name!r}: {'; '.join(problems)}")

    async def _ask(self, host: str, port: int) -> tuple[str, int] | None:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            auth = self.config.sentinel_auth()
            request = b""
            if auth:
                request += (_pack("AUTH", auth["username"], auth["password"]) if auth["username"]
                            else _pack("AUTH", auth["password"]))
            request += _pack("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.config.primary_name)
            writer.write(request)
            replies = await _read_replies(reader, 2 if auth else 1)
        finally:
            writer.close()
        if auth and isinstance(replies[0], hiredis.ReplyError):
            raise ConnectionError(f"Sentinel refused AUTH: {replies[0]}")
        reply = replies[-1]
        if isinstance(reply, hiredis.ReplyError):
            raise ConnectionError(f"Sentinel answered an error: {reply}")
        if not reply:
            return None
        ip, primary_port = reply
        return ip.decode(), int(primary_port)


async def _read_replies(reader: asyncio.StreamReader, num_replies: int) -> list[Any]:
    parser = hiredis.Reader(replyError=hiredis.ReplyError)
    replies: list[Any] = []
    while len(replies) < num_replies:
        data = await reader.read(4096)
        if not data:
            raise ConnectionError("the Sentinel closed the connection")
        parser.feed(data)
        while len(replies) < num_replies and (reply := parser.gets()) is not False:
            replies.append(reply)
    return replies
