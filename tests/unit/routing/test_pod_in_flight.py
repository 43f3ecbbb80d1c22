"""The pod's in-flight table (routing/pod_in_flight.py): every worker's counts summed, a row per worker held by
a lock the kernel drops with the process, a dead worker's counts cleared by its replacement, and a router
whose policy sees the requests another worker has in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing import pod_in_flight
from tessera.routing import router as router_module
from tessera.routing.pod_in_flight import ROW_ENTRIES, PodInFlight, key_map
from tessera.routing.router import Router
from tessera.routing.snapshot import RouteRequest

ENGINES = ["engine-a", "engine-b", "engine-c"]
KEYS = key_map(ENGINES)


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "pod.table"
    pod_in_flight.create(path, 2)
    return path


@pytest.fixture
def pods(table: Path) -> Iterator[tuple[PodInFlight, PodInFlight]]:
    first, second = PodInFlight.attach(table), PodInFlight.attach(table)
    assert first is not None and second is not None and first.row != second.row
    yield first, second
    first.close()
    second.close()


def test_every_workers_counts_are_summed(pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, second = pods
    first.add("engine-a", 1, 300)
    first.add("engine-b", 1, 0)
    second.add("engine-a", 2, 1000)
    assert first.totals(KEYS) == second.totals(KEYS) == ({"engine-a": 3, "engine-b": 1}, {"engine-a": 1300})
    first.add("engine-a", 0, -300)  # its first token: prefilled
    second.add("engine-a", -1, -500)
    assert second.totals(KEYS) == ({"engine-a": 2, "engine-b": 1}, {"engine-a": 500})


def test_an_engine_with_nothing_left_leaves_the_row_and_the_last_entry_takes_its_place(
        pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, _ = pods
    for engine_id in ENGINES:
        first.add(engine_id, 1, 10)
    first.add("engine-a", -1, -10)
    assert first.totals(KEYS) == ({"engine-b": 1, "engine-c": 1}, {"engine-b": 10, "engine-c": 10})
    first.add("engine-c", 1, 0)  # the moved entry is found where it went
    first.add("engine-a", 1, 0)  # and a new one goes after it
    assert first.totals(KEYS) == ({"engine-a": 1, "engine-b": 1, "engine-c": 2}, {"engine-b": 10, "engine-c": 10})
    for engine_id, requests, tokens in (("engine-a", 1, 0), ("engine-b", 1, 10), ("engine-c", 2, 10)):
        first.add(engine_id, -requests, -tokens)
    assert first.totals(KEYS) == ({}, {})
    assert first._own[0] == 0  # the row is empty again: readers walk nothing


def test_engines_gone_from_the_registry_are_skipped(pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, _ = pods
    first.add("engine-gone", 1, 100)
    first.add("engine-a", 1, 0)
    assert first.totals(KEYS) == ({"engine-a": 1}, {})


def test_a_full_row_counts_nothing_more_and_loses_nothing_it_holds(pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, second = pods
    many = [f"e{i}" for i in range(ROW_ENTRIES + 5)]
    for engine_id in many:
        first.add(engine_id, 1, 0)
    requests, _ = second.totals(key_map(many))
    assert len(requests) == ROW_ENTRIES and all(n == 1 for n in requests.values())
    first.add(many[-1], -1, 0)  # never counted here: nothing to take away
    assert second.totals(key_map(many))[0] == requests


CHILD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from tessera.routing.pod_in_flight import PodInFlight
    pod = PodInFlight.attach(Path(sys.argv[1]))
    if pod is None:
        print("none", flush=True)
        sys.exit(0)
    pod.add("engine-a", 5, 4096)
    print(pod.row, flush=True)
    time.sleep(60)
""")


def start_worker(table: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(table)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_killed_workers_row_goes_to_its_replacement_which_clears_what_it_left(table: Path) -> None:
    worker, row = start_worker(table)
    other, other_row = start_worker(table)
    try:
        assert {row, other_row} == {"0", "1"}
        assert PodInFlight.attach(table) is None  # every row held by a live process: none for a third
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        replacement = PodInFlight.attach(table)  # the kernel dropped the dead worker's lock: its row is free
        assert replacement is not None and str(replacement.row) == row
        # The dead worker's five requests are gone; the live one's remain.
        assert replacement.totals(KEYS) == ({"engine-a": 5}, {"engine-a": 4096})
        replacement.close()
    finally:
        for proc in (worker, other):
            proc.kill()
            proc.wait(timeout=10)


def test_a_table_without_a_free_row_attaches_nothing(tmp_path: Path) -> None:
    path = tmp_path / "one.table"
    pod_in_flight.create(path, 1)
    worker, row = start_worker(path)
    try:
        assert row == "0"
        assert PodInFlight.attach(path) is None
    finally:
        worker.kill()
        worker.wait(timeout=10)


async def test_a_router_routes_around_the_requests_another_worker_has_in_flight(
        redis_server: EmbeddedRedis, pods: tuple[PodInFlight, PodInFlight], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers' routers of one pod, on the session's Redis (a model and engines of this test's own)."""
    monkeypatch.setattr(router_module, "REGISTRY_CACHE_S", 60.0)
    redis = connect(redis_server.url, timeout_s=5.0)
    tag = uuid.uuid4().hex[:8]
    model, a, b = f"m-{tag}", f"a-{tag}", f"b-{tag}"
    registry = EngineRegistry(redis, 1.0)
    for engine_id in (a, b):
        await registry.heartbeat(EngineRecord(engine_id, f"http://{engine_id}", model, 32, 100, 2048))
    first_pod, second_pod = pods
    first = Router(redis, "least_loaded", pod=first_pod)
    second = Router(redis, "least_loaded", pod=second_pod)
    request = RouteRequest(tenant="t", model=model, num_prompt_tokens=10, block_hashes=())
    try:
        busy = (await first.route(request))[0].ranked[0]
        idle = b if busy == a else a
        with first.in_flight(busy), first.in_flight(busy):
            # Without the table the second worker sees two idle engines and least_loaded's tie-break, which
            # changes with every decision, picks either: eight alike are the loads it read from the table.
            assert {(await second.route(request))[0].ranked[0] for _ in range(8)} == {idle}
        assert second_pod.totals(key_map([a, b])) == ({}, {})
    finally:
        for router in (first, second):
            await router.close()
        await redis.aclose()


def test_a_gateway_with_several_workers_gets_a_fresh_table_of_a_row_each(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tessera.gateway.launch import prepare_pod_table

    monkeypatch.delenv(pod_in_flight.ENV_VAR, raising=False)
    assert prepare_pod_table(tmp_path, 1) is None and pod_in_flight.ENV_VAR not in os.environ
    table = prepare_pod_table(tmp_path, 3)
    assert table is not None and os.environ[pod_in_flight.ENV_VAR] == str(table)
    rows = [pod_in_flight.attach_from_env() for _ in range(3)]
    assert all(rows) and pod_in_flight.attach_from_env() is None
    assert rows[0] is not None
    rows[0].add("engine-a", 7, 0)
    left = table.read_bytes()  # what a killed pod leaves in its emptyDir
    for row in rows:
        assert row is not None
        row.close()
    table.write_bytes(left)
    # A restarted container keeps its emptyDir: the next run's table starts empty, whatever the last one held.
    assert prepare_pod_table(tmp_path, 3) == table
    fresh = PodInFlight.attach(table)
    assert fresh is not None and fresh.totals(KEYS) == ({}, {})
    fresh.close()
