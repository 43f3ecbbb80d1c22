"""Redis high availability (issue #16): SIGKILL the Sentinel-managed primary under admission load through a
real gateway; a replica is promoted and the gateway admits again, on its own, with no double admission beyond
the stated bound.

Real processes: valkey-server as primary, replica and three Sentinels (tests/support/sentinel_cluster.py),
one ``tessera gateway`` process given only the ``redis+sentinel://`` URL, and the fake engine replica
(tests/support/fake_engine.py: admission needs no vLLM), which heartbeats through the same URL.

The bound, checked here: the gateway never retries an admission whose reply was lost (it answers 503 with
Retry-After, and the script may have run: a slot used, never one given twice), so extra admissions can only
come from writes the old primary acknowledged and the promoted replica never received. Valkey streams each
write to its replicas as it replies, so a killed process loses at most what was acknowledged within the
replication lag (none, measured on loopback; docs/kubernetes.md "Redis high availability"). The test holds the
admitted count to ``requests_per_minute`` plus the admissions acknowledged within ``LOST_WINDOW_S`` before
the kill, and prints how long the gateway answered 503 before it admitted again (no timed assertion: only
``ADMIT_AGAIN_GUARD_S`` against a hang).
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tessera.redis_conn import connect
from tessera.redis_wire import RedisWire
from tessera.tenancy.admission import limiter_keys, usage_key
from tessera.tenancy.periods import period_window
from tessera.tenancy.store import TenantStore
from tests.support.fake_engine import running_fake_engine
from tests.support.gateways import GatewayProcess, running_gateways
from tests.support.poll import async_wait_until
from tests.support.sentinel_cluster import DOWN_AFTER_MS, SentinelCluster
from tests.support.swallowed_cancel import write_cancelling
from tests.support.tenancy import GATEWAY_ENV, TenantHandle, create_tenant

RPM_LIMIT = 160
ADMITTED_BEFORE_KILL = 60  # the kill comes once this many were admitted, then load continues to the limit
NUM_CLIENTS = 6
# What a killed primary may take with it: admissions it acknowledged that never reached the replica (the
# replication lag; Valkey sends a write to its replicas in the same event-loop pass as the reply).
LOST_WINDOW_S = 1.0
ADMIT_AGAIN_GUARD_S = 60.0
RUN_GUARD_S = 90.0
MODEL = "sentinel-failover"
BUDGET = 10_000_000


@contextmanager
def _cluster(**options: Any) -> Iterator[SentinelCluster]:
    # In memory where the machine has a tmpfs: the AOF must not wait on a busy disk.
    shm = Path("/dev/shm")
    root = Path(tempfile.mkdtemp(prefix="tessera-sentinel-", dir=shm if shm.is_dir() else None))
    cluster = SentinelCluster(root, num_sentinels=3, quorum=2, **options).start()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster() -> Iterator[SentinelCluster]:
    with _cluster(num_replicas=1) as cluster:
        yield cluster


@dataclass(slots=True)
class Outcome:
    sent_at: float
    answered_at: float
    status: int
    code: str | None


@dataclass
class Load:
    outcomes: list[Outcome] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def admitted(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == 200]

    def limit_reached(self) -> bool:
        return any(o.code == "requests_per_minute" for o in self.outcomes)


async def _client(load: Load, client: httpx.AsyncClient, gateway: GatewayProcess, tenant: TenantHandle) -> None:
    body = {"model": MODEL, "prompt": "failover", "max_tokens": 1}
    while not load.stop.is_set():
        sent_at = time.monotonic()
        try:
            response = await client.post(f"{gateway.url}/v1/completions", json=body, headers=tenant.headers)
        except httpx.TransportError:
            load.outcomes.append(Outcome(sent_at, time.monotonic(), 0, "transport"))
            await asyncio.sleep(0.05)
            continue
        code = None if response.status_code == 200 else response.json()["error"]["code"]
        load.outcomes.append(Outcome(sent_at, time.monotonic(), response.status_code, code))
        if response.status_code == 503:
            await asyncio.sleep(0.05)  # Retry-After says 1 s; a test that measures recovery asks sooner
        elif response.status_code == 429:
            # The limit is reached and the test ends at the next check; without a pause six clients refused
            # in a tight loop (~700/s) starved whatever ran beside them on a 2-core machine (the other
            # pytest worker's vLLM engine stalled for a minute in CI).
            await asyncio.sleep(0.05)


async def test_a_replica_is_promoted_and_the_gateway_admits_again_without_double_admission(
        cluster: SentinelCluster, small_model_dir: Path, tmp_path: Path) -> None:
    url = cluster.url()
    with running_fake_engine(url, MODEL, small_model_dir, line_gap_s=0.0), \
            running_gateways(1, url, tmp_path, GATEWAY_ENV) as (gateway,):
        tenant = create_tenant(gateway, {"requestsPerMinute": RPM_LIMIT, "tokenBudget": BUDGET,
                                         "budgetPeriod": "day"}, prefix="failover")
        load = Load()
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 2, max_keepalive_connections=NUM_CLIENTS + 2)
        async with httpx.AsyncClient(timeout=30.0, limits=limits) as client:
            clients = [asyncio.create_task(_client(load, client, gateway, tenant)) for _ in range(NUM_CLIENTS)]
            try:
                await async_wait_until(lambda: len(load.admitted()) >= ADMITTED_BEFORE_KILL, RUN_GUARD_S,
                                       f"{ADMITTED_BEFORE_KILL} admissions before the kill")
                old_primary = cluster.primary()
                old_primary.kill()
                killed_at = time.monotonic()
                await async_wait_until(lambda: any(o.status == 200 and o.sent_at > killed_at
                                                   for o in load.outcomes),
                                       ADMIT_AGAIN_GUARD_S, "an admission after the primary was killed")
                admitting_again_at = min(o.answered_at for o in load.outcomes
                                         if o.status == 200 and o.sent_at > killed_at)
                await async_wait_until(load.limit_reached, RUN_GUARD_S, "the requests_per_minute limit")
            finally:
                load.stop.set()
                await asyncio.gather(*clients)
        new_primary = cluster.primary()
        assert new_primary is not old_primary and new_primary.alive(), "a replica was promoted"
        first = min(o.sent_at for o in load.outcomes)
        last = max(o.answered_at for o in load.outcomes)
        assert last - first < 60, (
            f"whole load {last - first:.1f} s: kill at +{killed_at - first:.1f} s, admitting again at "
            f"+{admitting_again_at - first:.1f} s, {Counter((o.status, o.code) for o in load.outcomes)}")

        admitted = load.admitted()
        in_lost_window = [o for o in admitted if killed_at - LOST_WINDOW_S <= o.answered_at <= killed_at]
        assert len(admitted) <= RPM_LIMIT + len(in_lost_window), (
            f"{len(admitted)} admitted against a limit of {RPM_LIMIT}: more than the "
            f"{len(in_lost_window)} acknowledged within {LOST_WINDOW_S} s of the kill could explain")

        # The new primary has the tenant, its key, its budget and its rate window.
        redis = connect(url, timeout_s=5.0)
        try:
            store = TenantStore(redis)
            assert await store.get_tenant(tenant.name) is not None
            assert await store.authenticate(tenant.key) == tenant.name
            period_id, _ = period_window("day", datetime.now(UTC))
            rpm_key, _, _, _, budget_key = limiter_keys(tenant.name, period_id)
            assert int(await redis.get(budget_key) or 0) > 0 and await redis.ttl(budget_key) > 0
            num_in_window = await redis.zcard(rpm_key)
            # Every admission acknowledged before the lost window is in the promoted replica's window.
            assert num_in_window >= len(admitted) - len(in_lost_window), (num_in_window, len(admitted))
            assert num_in_window <= RPM_LIMIT  # the script's own invariant, on the new primary too

            # Usage: each admitted request's finish lands (on the new primary, or parked and replayed).
            async def requests_billed() -> int:
                return int(await redis.hget(usage_key(tenant.name, period_id), "requests") or 0)

            async def all_billed() -> bool:
                return await requests_billed() >= len(admitted) - len(in_lost_window)

            await async_wait_until(all_billed, 30.0, "the admitted requests' finishes")
            billed = await requests_billed()
        finally:
            await redis.aclose()

    unavailable = [o for o in load.outcomes if o.status == 503]
    # NOTE: engine_unavailable: admitted, then no live replica; the fake replica's registry entry (TTL 2 s)
    # can lapse while its heartbeats wait for the new primary. Those count in the window and are billed.
    print(f"\nprimary SIGKILLed after {ADMITTED_BEFORE_KILL}+ admissions; gateway admitting again "
          f"{admitting_again_at - killed_at:.2f} s later (Sentinel down-after {DOWN_AFTER_MS} ms); "
          f"503 meanwhile: {Counter(str(o.code) for o in unavailable)}; {len(admitted)} served (200) of a "
          f"{RPM_LIMIT} rpm limit; {num_in_window} admissions in the new primary's window, {billed} billed; "
          f"{len(in_lost_window)} served within {LOST_WINDOW_S} s before the kill")



async def test_a_primary_replaced_while_it_runs_loses_its_clients_to_the_new_one() -> None:
    """SENTINEL FAILOVER promotes a replica while the old primary runs on (as a partition would leave it);
    the Sentinels reconfigure the old one only when they next look at it, seconds later. With
    min-replicas-to-write (the chart's setting), the old primary refuses writes once its replicas have left
    it (NOREPLICAS), and both the lean connection and the redis-py client take that as a lost connection
    and ask the Sentinels again: they write to the new primary while the old one still calls itself primary,
    and never write to a replica (every refusal is a connection error, none a plain error reply)."""
    with _cluster(num_replicas=2, data_config=["min-replicas-to-write 1", "min-replicas-max-lag 1"]) as cluster:
        url = cluster.url()
        wire, client = RedisWire(url, timeout_s=1.0), connect(url, timeout_s=1.0)
        try:
            assert await wire.execute([("SET", "wire", "0")]) == [b"OK"]
            await client.set("client", "0")
            old = cluster.primary()
            cluster.failover()
            await async_wait_until(lambda: cluster.primary() is not old, 30.0, "a replica promoted")
            new = cluster.primary()
            refusals: Counter[str] = Counter()

            async def moved() -> bool:
                try:
                    (reply,) = await wire.execute([("INCR", "wire")])
                    assert not isinstance(reply, Exception), f"an error reply in place: {reply}"
                    await client.incr("client")
                except RedisConnectionError as exc:
                    refusals[str(exc).split(":")[0]] += 1
                with new.client() as direct:
                    return int(direct.get("wire") or 0) > 0 and int(direct.get("client") or 0) > 0

            await async_wait_until(moved, 30.0, "both clients writing to the new primary")
            with old.client() as direct:
                role = direct.execute_command("ROLE")[0]
            print(f"\nclients moved to the new primary while the old one's role was {role!r}; refused "
                  f"meanwhile: {dict(refusals)}")
            assert role == b"master", "the clients moved before the Sentinels demoted the old primary"
        finally:
            await wire.close()
            await client.aclose()


async def test_a_cancellation_the_write_swallowed_is_raised_on_the_sentinels_primary_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The Sentinel-managed connection raises a cancellation that redis-py's write swallowed, as ``connect``'s
    other connections do (tessera/swallowed_cancel.py; tests/unit/platform/test_redis_swallowed_write.py)."""
    with _cluster(num_replicas=0) as cluster:
        client = connect(cluster.url(), timeout_s=5.0, pool_size=1)
        task: asyncio.Task[object] | None = None
        try:
            await client.set("swallowed", "before")
            write_cancelling(monkeypatch, lambda: task)
            task = asyncio.create_task(client.set("swallowed", "cancelled"))
            await asyncio.wait({task}, timeout=10)
            monkeypatch.undo()
            assert task.done() and task.cancelled(), "the command returned: its cancellation was swallowed"
            assert await client.get("swallowed") in (b"before", b"cancelled")
        finally:
            await client.aclose()
