"""A restarted Redis accepts connections before its data is back: until the append-only file or snapshot is
loaded it answers every command with ``LOADING``. Over the gateway's lean wire that reply must read as
"Redis unavailable" (redis-py's ``BusyLoadingError``, a ``ConnectionError``), as it does over redis-py:
admission fails closed with the 503, and a finish waits in the billing queue and is recorded once the load
is done. Read as a plain error reply, the admission was a 500 and the finish was dropped as unrecordable,
losing the usage of every request whose retry met the load (CI saw a fail-open request's 4 tokens vanish
after a Redis restart).

A real valkey-server holds the LOADING state for as long as the test needs: ``key-load-delay`` (µs per key)
stretches the load of a snapshot with many keys past a minute, a small ``loading-process-events-interval-bytes``
makes it answer meanwhile, and the test ends the load itself by setting the delay to 0 (CONFIG SET is served
while loading). The phase does not depend on how fast this machine loads or how busy it is.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from redis.exceptions import BusyLoadingError

from tessera.gateway.errors import STORE_ERRORS
from tessera.redis_conn import connect
from tessera.redis_wire import RedisWire
from tessera.tenancy.admission import Admission, Lease
from tessera.tenancy.admission_trip import build_trip, parse_trip
from tessera.tenancy.billing import FinishQueue
from tessera.tenancy.policy import TenantPolicy
from tessera.tenancy.store import TenantStore
from tests.support.machine import free_port
from tests.support.sentinel_cluster import PASSWORD, Node

POLICY = TenantPolicy(token_budget=1_000_000, budget_period="day")
# 60,000 keys at 1 ms each: a load of over a minute unless the test ends it (release_loading).
FILLER_KEYS = 60_000
LOAD_DELAY_US = 1_000


def _is_store_error(exc: BaseException) -> bool:
    return isinstance(exc, STORE_ERRORS)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    server = Node("primary", free_port(), tmp_path / "primary",
                  ['save ""', "appendonly no", f"requirepass {PASSWORD}", f"key-load-delay {LOAD_DELAY_US}",
                   "loading-process-events-interval-bytes 1024"])
    server.start()
    server.wait_ready()
    yield server
    server.stop()


@pytest.fixture
async def wire(node: Node) -> AsyncIterator[RedisWire]:
    lean = RedisWire(f"redis://:{PASSWORD}@127.0.0.1:{node.port}/0", timeout_s=5.0)
    yield lean
    await lean.close()


def restart_into_loading(node: Node) -> None:
    """Snapshots what is there (with enough filler to load for over a minute), restarts, and returns once the
    server answers LOADING. The load lasts until release_loading."""
    with node.client() as client:
        pipe = client.pipeline(transaction=False)
        for i in range(FILLER_KEYS):
            pipe.set(f"filler:{i}", "x")
        pipe.execute()
        client.save()
    node.stop()
    node.start()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            with node.client(retries=False) as client:
                client.ping()
        except BusyLoadingError:
            return
        except redis.ConnectionError:
            time.sleep(0.01)  # not listening yet
            continue
        raise AssertionError("the server finished loading before the test could act: it should have taken "
                             f"{FILLER_KEYS * LOAD_DELAY_US / 1e6:.0f} s\n{node.log_tail()}")
    raise AssertionError(f"the server never answered:\n{node.log_tail()}")


def release_loading(node: Node) -> None:
    """Ends the load at once: with no delay per key the rest of the snapshot loads in milliseconds."""
    with node.client(retries=False) as client:
        client.config_set("key-load-delay", 0)


async def test_a_loading_redis_fails_admission_closed_and_the_finish_waits_until_it_is_back(
        node: Node, wire: RedisWire) -> None:
    client = connect(f"redis://:{PASSWORD}@127.0.0.1:{node.port}/0", timeout_s=5.0)
    await TenantStore(client).create_tenant("t", POLICY)
    admission = Admission(client, wire=wire)
    lease = await admission.admit("t", POLICY, 100)
    assert isinstance(lease, Lease)

    restart_into_loading(node)

    # Admission's round trip (as the gateway sends it) fails as "Redis unavailable": the 503, not a 500.
    trip = build_trip(admission, "t", POLICY, 100, None)
    with pytest.raises(STORE_ERRORS) as raised:
        await parse_trip(admission, trip, await wire.execute(trip.commands))
    assert isinstance(raised.value, BusyLoadingError), raised.value
    # The finish is parked, not dropped...
    queue = FinishQueue(admission, _is_store_error)
    await queue.finish(lease, 10, 20)
    await queue.read_replies()  # an unhurried finish: its LOADING reply read now, not at the second
    assert queue.num_parked == 1
    # ...and recorded once the load is done.
    release_loading(node)
    await queue.close(timeout_s=30.0)
    assert queue.num_parked == 0
    assert (await admission.usage("t", "day"))["total_tokens"] == 30
    await client.aclose()


async def test_a_loading_reply_over_the_wire_is_redis_py_s_busy_loading_error(node: Node, wire: RedisWire) -> None:
    """Both clients raise the same type for the same reply, so every caller handles them alike."""
    restart_into_loading(node)
    (reply,) = await wire.execute([("GET", "filler:1")])
    assert isinstance(reply, BusyLoadingError) and "loading" in str(reply).lower()
