"""One multiplexed Redis connection for the gateway's request path: commands in, replies out, nothing else.

Why not redis-py's pipeline: every request pays one round trip before its engine call (admission), and the
same bytes over a plain asyncio protocol cost less than through ``redis.asyncio`` (with hiredis), back to
back and as the first call after an idle spell; ``make bench-wires`` measures both side by side
(bench/bench_wires.py).

Concurrent callers share the connection: each call writes its commands in one ``write`` and awaits as many
replies, matched in order (Redis answers a connection's commands in the order they arrive). A timeout or a
lost connection fails every pending call and drops the connection, since a late reply would otherwise be
handed to the next caller; the next call reconnects. Errors are redis-py's own exception types, so callers
handle both clients alike (``NoScriptError`` for NOSCRIPT, ``OutOfMemoryError`` for a server at maxmemory,
``BusyLoadingError`` — a ``ConnectionError``, so "Redis unavailable" — for a server still loading its data
after a restart or busy in a long script, ``ResponseError`` for the other error replies).

Unhurried calls (``send_unhurried``). A caller that needs its reply only eventually (the gateway's finish, sent
after the response is complete: Redis applies it on receipt, the reply only says whether it did) gets its
reply's future back as soon as the commands are written. While no other caller waits, the connection stops
reading, so the reply does not wake the process on its own: on this project's VMs a wake-up costs 90-220 us of
CPU (docs/performance.md section 9, "Wake-ups"), more than the reply's parsing. The reply is read with the next
caller's (every request's admission) or at the next whole second of the monotonic clock (wake_grid.py, when the
process wakes for its refreshers), whichever comes first; its timeout counts from that second.

Failover. With a ``redis+sentinel://`` URL each new connection first asks the Sentinels for the primary
(``redis_sentinel.SentinelResolver``) and checks ``ROLE`` with its AUTH/SELECT before any command is sent: a
server that is not (or no longer) the primary is refused as a failed connection. A ``READONLY`` reply (the
server was demoted under an open connection) or ``NOREPLICAS`` (a primary that lost its replicas, often to a
failover it has not heard of yet) fails the whole call and every pending one with ``ConnectionError`` and
drops the connection, so the next call asks the Sentinels again; with a plain URL the
next call connects again (a DNS name that follows the primary then resolves anew). Nothing is retried here:
a call whose reply was lost may have run (an admission script that was applied), and only its caller can
tell whether running it twice is safe (the gateway answers 503: docs/kubernetes.md "Redis high
availability").
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import hiredis
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection, parse_url
from redis.exceptions import BusyLoadingError, NoScriptError, OutOfMemoryError, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from tessera.redis_sentinel import SentinelResolver, is_sentinel_url, parse_sentinel_url
from tessera.redis_tls import tls_context
from tessera.resp import Command, pack_commands
from tessera.wake_grid import GRID_S, until_next

# Replies from a server that is up but cannot run commands yet: loading its append-only file or snapshot
# (a restarted Redis accepts connections before its data is back), or blocked in a long script. redis-py
# raises ``BusyLoadingError`` for LOADING, a ``ConnectionError``: the caller waits as for a Redis that is
# down (503 fail-closed, a finish parked and retried), where a plain ``ResponseError`` would be a 500 and a
# finish dropped as unrecordable.
NOT_READY = ("LOADING", "BUSY ")


def as_redis_error(reply: hiredis.ReplyError) -> Exception:
    message = str(reply)
    if message.startswith(NOT_READY):
        return BusyLoadingError(message)
    if message.startswith("NOSCRIPT"):
        return NoScriptError(message)
    if message.startswith("OOM"):
        return OutOfMemoryError(message)  # noeviction at maxmemory: the billing queue waits on it (billing.py)
    return ResponseError(message)


# Replies from a server that must not take this connection's writes: a replica (READONLY: a failover demoted
# it), or a primary that lost its replicas (NOREPLICAS, min-replicas-to-write: cut off from them, or replaced
# by one of them and not yet told). Either fails the call as a lost connection (503, a finish parked and
# retried) and drops it, so the next call asks the Sentinels again.
NOT_WRITABLE = ("READONLY", "NOREPLICAS")


class _Call:
    """One caller's commands in flight: its replies so far, and the future that gets all of them."""

    __slots__ = ("future", "hurried", "remaining", "replies")

    def __init__(self, future: asyncio.Future[list[Any]], num_commands: int, hurried: bool = True) -> None:
        self.future = future
        self.remaining = num_commands
        self.replies: list[Any] = []
        self.hurried = hurried  # its caller awaits the reply now (False: ``send_unhurried``)


class _Protocol(asyncio.Protocol):
    def __init__(self) -> None:
        self.reader = hiredis.Reader(replyError=hiredis.ReplyError)
        self.waiting: deque[_Call] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        # Reading stopped while only unhurried calls wait, and the timer that starts it again at the grid.
        self.holding = False
        self._grid_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def hold_replies(self) -> None:
        """Stops reading where no caller awaits a reply now, until ``read_now`` or the next whole second."""
        if self.transport is None or any(call.hurried for call in self.waiting):
            return  # a reply someone awaits is on its way: the held ones come with it
        if not self.holding:
            self.holding = True
            self.transport.pause_reading()
        if self._grid_timer is None:
            loop = asyncio.get_running_loop()
            self._grid_timer = loop.call_later(until_next(GRID_S), self.read_now)

    def read_now(self) -> None:
        """Reads again (the held replies first, in order)."""
        if self._grid_timer is not None:
            self._grid_timer.cancel()
            self._grid_timer = None
        if self.holding:
            self.holding = False
            if self.transport is not None and not self.transport.is_closing():
                self.transport.resume_reading()

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while self.waiting:
            reply = self.reader.gets()
            if reply is False:
                return
            if isinstance(reply, hiredis.ReplyError) and str(reply).startswith(NOT_WRITABLE):
                self.not_writable(str(reply))
                return
            call = self.waiting[0]
            call.replies.append(as_redis_error(reply) if isinstance(reply, hiredis.ReplyError) else reply)
            call.remaining -= 1
            if not call.remaining:
                self.waiting.popleft()
                if not call.future.done():
                    call.future.set_result(call.replies)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = RedisConnectionError(f"connection to Redis lost: {exc or 'closed by the server'}")
        self.fail_all(self.lost)
        if self._grid_timer is not None:
            self._grid_timer.cancel()
            self._grid_timer = None

    def not_writable(self, message: str) -> None:
        """The server takes no writes as a primary (``NOT_WRITABLE``): this connection is done."""
        self.lost = RedisConnectionError(f"Redis is not a primary that takes writes: {message}")
        self.fail_all(self.lost)
        if self.transport is not None:
            self.transport.abort()

    def fail_all(self, exc: BaseException) -> None:
        while self.waiting:
            call = self.waiting.popleft()
            if not call.future.done():
                call.future.set_exception(exc)


class RedisWire:
    """``execute`` sends commands in one write and returns their replies in order; an error reply comes back
    as an exception object in its place (as ``pipeline.execute(raise_on_error=False)`` does). Connection
    trouble and timeouts raise redis-py's ``ConnectionError`` / ``TimeoutError``."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self._resolver: SentinelResolver | None = None
        if is_sentinel_url(url):
            config = parse_sentinel_url(url)
            self._resolver = SentinelResolver(config, timeout_s)
            self._options: dict[str, Any] = {"db": config.db, **config.data_server_auth()}
        else:
            self._options = dict(parse_url(url))
        self._timeout_s = timeout_s
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Lock | None = None

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    async def execute(self, commands: list[Command], timeout_s: float | None = None) -> list[Any]:
        """``timeout_s``: this call's reply timeout (default: the wire's), e.g. a blocking read's block plus
        the wire's own. Every call after it on the connection waits for it: block only on a wire of your own."""
        if not commands:
            return []
        protocol = await self._connected()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        protocol.waiting.append(_Call(future, len(commands)))
        assert protocol.transport is not None
        protocol.transport.write(pack_commands(commands))
        if protocol.holding:
            protocol.read_now()
        # A plain timer rather than ``asyncio.timeout``: one call_later and one cancel, on every request.
        limit_s = self._timeout_s if timeout_s is None else timeout_s
        timer = loop.call_later(limit_s, self._time_out, protocol, future, limit_s)
        try:
            return await future
        finally:
            timer.cancel()

    async def send_unhurried(self, commands: list[Command]) -> asyncio.Future[list[Any]]:
        """Writes the commands and returns the future of their replies, read with the next caller's or at the
        next whole second (module docstring): returns once written (or raises as ``execute`` does when there is
        no connection). The reply's timeout counts from that second. Await the future, or ``read_replies`` to
        have it read now."""
        protocol = await self._connected()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Any]] = loop.create_future()
        protocol.waiting.append(_Call(future, len(commands), hurried=False))
        assert protocol.transport is not None
        protocol.transport.write(pack_commands(commands))
        protocol.hold_replies()
        limit_s = self._timeout_s + GRID_S
        timer = loop.call_later(limit_s, self._time_out, protocol, future, limit_s)
        future.add_done_callback(lambda _: timer.cancel())
        return future

    def read_replies(self) -> None:
        """Reads the unhurried calls' replies now (a shutdown that waits for them)."""
        if self._protocol is not None:
            self._protocol.read_now()

    def _time_out(self, protocol: _Protocol, future: asyncio.Future[list[Any]], limit_s: float) -> None:
        if not future.done():
            self._drop(protocol, RedisTimeoutError(f"Redis did not answer within {limit_s} s"))

    async def close(self) -> None:
        if self._protocol is not None:
            self._drop(self._protocol, RedisConnectionError("connection closed"))

    def _drop(self, protocol: _Protocol, exc: BaseException) -> None:
        protocol.fail_all(exc)
        protocol.read_now()  # stops its grid timer
        if protocol.transport is not None:
            protocol.transport.abort()
        if self._protocol is protocol:
            self._protocol = None

    async def _connected(self) -> _Protocol:
        protocol = self._protocol
        if protocol is not None and protocol.lost is None:
            return protocol
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:  # one connect for all the callers that found none
            if self._protocol is None or self._protocol.lost is not None:
                self._protocol = await self._open()
            return self._protocol

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        options = self._options
        protocol: _Protocol | None = None
        # The Sentinels each get their own timeout (a dead one must not use up the connection's).
        primary = None if self._resolver is None else await self._resolver.primary_address()
        try:
            async with asyncio.timeout(self._timeout_s):
                if primary is not None:
                    _, protocol = await loop.create_connection(_Protocol, *primary)
                elif options.get("connection_class") is UnixDomainSocketConnection:
                    _, protocol = await loop.create_unix_connection(_Protocol, options["path"])
                else:
                    tls = tls_context(options) if options.get("connection_class") is SSLConnection else None
                    _, protocol = await loop.create_connection(
                        _Protocol, options.get("host", "localhost"), int(options.get("port", 6379)), ssl=tls)
                await self._set_up(protocol)
            return protocol
        except BaseException as exc:
            if protocol is not None and protocol.transport is not None:
                protocol.transport.abort()
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"could not connect to Redis within {self._timeout_s} s") from None
            if isinstance(exc, OSError):
                raise RedisConnectionError(f"could not connect to Redis: {exc}") from exc
            raise

    async def _set_up(self, protocol: _Protocol) -> None:
        """AUTH and SELECT as the URL asks (the same URL the redis-py clients use); behind Sentinels also
        ROLE, since a Sentinel may still name a primary that a failover has just demoted."""
        options = self._options
        setup: list[Command] = []
        if options.get("password"):
            user = options.get("username")
            setup.append(("AUTH", user, options["password"]) if user else ("AUTH", options["password"]))
        if int(options.get("db", 0)):
            setup.append(("SELECT", int(options["db"])))
        if self._resolver is not None:
            setup.append(("ROLE",))
        if not setup:
            return
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        protocol.waiting.append(_Call(future, len(setup)))
        assert protocol.transport is not None
        protocol.transport.write(pack_commands(setup))
        replies = await future
        for reply in replies:
            if isinstance(reply, Exception):
                raise RedisConnectionError(f"Redis refused the connection set-up: {reply}")
        if self._resolver is not None and replies[-1][0] != b"master":
            raise RedisConnectionError(f"the server the Sentinels name for {self._resolver.config.primary_name!r} "
                                       f"is a {replies[-1][0].decode()}, not the primary (a failover in progress)")


async def run_script(wire: RedisWire | None, script: Any, keys: list[Any], args: list[Any]) -> Any:
    """A redis-py registered script (``redis.register_script``) run over ``wire`` when the caller has one, or
    with redis-py. NOSCRIPT (a restarted Redis lost its scripts) falls back to redis-py's call, which loads
    the script; any other error reply is raised."""
    if wire is not None:
        (reply,) = await wire.execute([("EVALSHA", script.sha, len(keys), *keys, *args)])
        if not isinstance(reply, NoScriptError):
            if isinstance(reply, Exception):
                raise reply
            return reply
    return await script(keys=keys, args=args)


def unhurried_failure(reply: asyncio.Future[list[Any]]) -> BaseException | None:
    """What became of an unhurried call of one command (``RedisWire.send_unhurried``), for its done callback: None
    where Redis answered it, else the failure: ``asyncio.CancelledError`` where the call was cancelled, the
    exception it failed with (a lost connection, a timeout), or the command's own error reply (NOSCRIPT, OOM)."""
    if reply.cancelled():
        return asyncio.CancelledError()
    failure = reply.exception()
    if failure is not None:
        return failure
    (answer,) = reply.result()
    return answer if isinstance(answer, Exception) else None
