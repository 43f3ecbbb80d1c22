"""The pod's in-flight table (routing/pod_in_flight.py): every worker's counts and prefill waits summed, a row per
worker held by a lock the kernel drops with the process, a dead worker's counts cleared by its replacement, and a router
whose policy sees the requests another worker has in flight."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.redis_conn import EmbeddedRedis, connect
from tessera.registry import EngineRecord, EngineRegistry
from tessera.routing import pod_in_flight
from tessera.routing import router as router_module
from tessera.routing.pod_in_flight import ROW_ENTRIES, PodInFlight
from tessera.routing.pod_view import PodEngines
from tessera.routing.prefill_clock import MIN_SAMPLES, PrefillClock
from tessera.routing.router import InFlight, Router
from tessera.routing.snapshot import RouteRequest

ENGINES = ["engine-a", "engine-b", "engine-c"]
KEYS = PodEngines(ENGINES)


def counts(pod: PodInFlight, keys: PodEngines) -> tuple[dict[str, int], dict[str, int]]:
    """The pod's requests and prefill tokens per engine (``totals`` less the waits)."""
    requests, tokens, _ = pod.totals(keys, 0.0)
    return dict(requests), dict(tokens)  # copies: the view's own dicts change with the table


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
    assert counts(first, KEYS) == counts(second, KEYS) == ({"engine-a": 3, "engine-b": 1}, {"engine-a": 1300})
    first.add("engine-a", 0, -300)  # its first token: prefilled
    second.add("engine-a", -1, -500)
    assert counts(second, KEYS) == ({"engine-a": 2, "engine-b": 1}, {"engine-a": 500})


def test_each_workers_prefill_wait_is_summed_from_the_shared_clock(pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, second = pods
    now = 1_000.0
    first.add("engine-a", 1, 300)
    first.add("engine-a", 0, 0, now + 0.040)
    second.add("engine-a", 1, 1000)
    second.add("engine-a", 0, 0, now + 0.100)
    second.add("engine-b", 1, 200)
    second.add("engine-b", 0, 0, now - 0.010)  # due already (late): no wait, never a negative one
    first.add("engine-c", 1, 0)
    first.add("engine-c", 0, 0, now + 5.0)  # nothing of it to prefill: no wait either
    waits = first.totals(KEYS, now).waits
    assert waits.keys() == {"engine-a"} and waits["engine-a"] == pytest.approx(0.140, abs=2e-6)
    second.add("engine-a", 0, 0, 0.0)  # not known (no fit yet): counts nothing
    assert first.totals(KEYS, now).waits["engine-a"] == pytest.approx(0.040, abs=2e-6)
    first.add("engine-a", 0, -300)  # prefilled: its stamp no longer counts
    assert "engine-a" not in second.totals(KEYS, now).waits


def test_a_wait_reads_right_across_the_stamps_wrap(pods: tuple[PodInFlight, PodInFlight]) -> None:
    """Stamps are microseconds modulo 2**32 (~71.6 minutes): a finish just past the wrap, read just before it,
    is a few milliseconds ahead, not an hour behind."""
    first, _ = pods
    wrap_s = 2 ** 32 / 1e6
    now = 7 * wrap_s - 0.002
    first.add("engine-a", 1, 100)
    first.add("engine-a", 0, 0, 7 * wrap_s + 0.003)
    assert first.totals(KEYS, now).waits["engine-a"] == pytest.approx(0.005, abs=2e-6)


def test_an_entry_moved_in_the_row_keeps_its_wait(pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, _ = pods
    first.add("engine-a", 1, 0)
    first.add("engine-b", 1, 500)
    first.add("engine-b", 0, 0, 10.25)
    first.add("engine-a", -1, 0)  # engine-b's entry takes engine-a's place
    assert first.totals(KEYS, 10.0).waits == pytest.approx({"engine-b": 0.25}, abs=2e-6)


def test_a_flight_publishes_its_workers_prefill_wait_until_its_first_token(
        pods: tuple[PodInFlight, PodInFlight]) -> None:
    """router.InFlight with a prefill clock that has its fit: while the prompt awaits its first token the other
    worker reads the engine's wait; a first token is a sample of the fit, the end without one is not."""
    first, second = pods
    clock = PrefillClock()
    for i in range(MIN_SAMPLES):  # 10 ms a token: waits of seconds, which a loaded machine's pause cannot eat
        clock.first_token("warm", clock.dispatch("warm", 100 + 20 * i, 0.0, isolated=True), 0.01 * (100 + 20 * i))
    assert clock.fit is not None
    with InFlight(first, "engine-a", 500, clock, isolated=True) as flight:
        wait = second.totals(KEYS, time.monotonic()).waits["engine-a"]
        assert 4.0 < wait <= 5.0 + 1e-6  # 5 s from its dispatch, a moment ago
        flight.prefilled()
        assert second.totals(KEYS, time.monotonic()).waits == {}
    assert clock.num_samples == MIN_SAMPLES + 1
    with InFlight(first, "engine-a", 500, clock, isolated=True):
        pass  # refused: no first token
    assert clock.num_samples == MIN_SAMPLES + 1 and counts(second, KEYS) == ({}, {})


def test_an_engine_with_nothing_left_leaves_the_row_and_the_last_entry_takes_its_place(
        pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, _ = pods
    for engine_id in ENGINES:
        first.add(engine_id, 1, 10)
    first.add("engine-a", -1, -10)
    assert counts(first, KEYS) == ({"engine-b": 1, "engine-c": 1}, {"engine-b": 10, "engine-c": 10})
    first.add("engine-c", 1, 0)  # the moved entry is found where it went
    first.add("engine-a", 1, 0)  # and a new one goes after it
    assert counts(first, KEYS) == ({"engine-a": 1, "engine-b": 1, "engine-c": 2}, {"engine-b": 10, "engine-c": 10})
    for engine_id, requests, tokens in (("engine-a", 1, 0), ("engine-b", 1, 10), ("engine-c", 2, 10)):
        first.add(engine_id, -requests, -tokens)
    assert counts(first, KEYS) == ({}, {})
    assert first._own[0] == 0  # the row is empty again: readers walk nothing


def test_engines_gone_from_the_registry_are_skipped(pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, _ = pods
    first.add("engine-gone", 1, 100)
    first.add("engine-a", 1, 0)
    assert counts(first, KEYS) == ({"engine-a": 1}, {})


def test_a_full_row_counts_nothing_more_and_loses_nothing_it_holds(pods: tuple[PodInFlight, PodInFlight]) -> None:
    first, second = pods
    many = [f"e{i}" for i in range(ROW_ENTRIES + 5)]
    for engine_id in many:
        first.add(engine_id, 1, 0)
    requests, _ = counts(second, PodEngines(many))
    assert len(requests) == ROW_ENTRIES and all(n == 1 for n in requests.values())
    first.add(many[-1], -1, 0)  # never counted here: nothing to take away
    assert counts(second, PodEngines(many))[0] == requests


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
        assert counts(replacement, KEYS) == ({"engine-a": 5}, {"engine-a": 4096})
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
        # The registry read hands its engines to the table's view then, not to the next decision to do.
        await first.num_live_engines()
        assert first_pod._view.engines is first._counted_engines and len(first._counted_engines.by_key) >= 2
        busy = (await first.route(request))[0].ranked[0]
        idle = b if busy == a else a
        with first.in_flight(busy), first.in_flight(busy):
            # Without the table the second worker sees two idle engines and least_loaded's tie-break, which
            # changes with every decision, picks either: eight alike are the loads it read from the table.
            assert {(await second.route(request))[0].ranked[0] for _ in range(8)} == {idle}
        assert counts(second_pod, PodEngines([a, b])) == ({}, {})
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
    assert fresh is not None and counts(fresh, KEYS) == ({}, {})
    fresh.close()
