"""Background loops that call Redis end when cancelled, though a call swallowed the cancellation
(swallowed_cancel.py): Python 3.11's ``asyncio.wait_for`` inside redis-py returns the result when a cancellation
lands as the awaited write completes, and a loop that went on left its canceller waiting for good (a hung
`make test`: the heartbeat's, mended first). Beside the real Redis, one call of each loop swallows the
cancellation as ``wait_for`` does; each loop must still end, cancelled. Every test ends its loop by other means
afterwards, so a regression fails it instead of hanging it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from tessera.engine.heartbeat import heartbeat_loop
from tessera.engine.protocol import parse_usage, usage_record_key
from tessera.engine.sim.fleet_redis import FleetRedis
from tessera.engine.usage_record import RecorderConfig, UsageRecord, UsageRecorder
from tessera.gateway.settler import Settler
from tessera.redis_conn import EmbeddedRedis, connect
from tessera.redis_wire import RedisWire
from tessera.registry import EngineRecord, EngineRegistry, ModelInfo
from tessera.routing.indexer import feed_index
from tessera.routing.kv_events import DecodedBatch
from tessera.routing.prefix_index import PrefixIndex
from tessera.swallowed_cancel import raise_if_cancelled
from tessera.tenancy.admission import Admission
from tests.support.swallowed_cancel import cancelled_while_in_call, sleeps_raising, swallowing


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = EmbeddedRedis().start()
    yield server.url
    server.stop()


async def test_the_guard_raises_only_where_a_cancellation_was_lost() -> None:
    raise_if_cancelled()  # a task never cancelled: nothing to do

    async def loop_that_loses_one(in_call: asyncio.Event) -> int:
        turns = 0
        while True:
            raise_if_cancelled()
            turns += 1
            await swallowing(asyncio.sleep, in_call)(0)
            if turns > 1_000:
                return turns  # the guard did not end the loop

    in_call = asyncio.Event()
    await cancelled_while_in_call(asyncio.create_task(loop_that_loses_one(in_call)), in_call, lambda: None)


async def test_the_guard_leaves_a_task_that_uncancelled_itself_alone() -> None:
    async def absorbs_then_guards() -> str:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            assert task is not None
            task.uncancel()  # a cancellation handled on purpose, as asyncio.timeout does
        raise_if_cancelled()
        return "went on"

    task = asyncio.create_task(absorbs_then_guards())
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "went on"


async def test_the_engines_heartbeat_ends_though_a_beat_swallowed_its_cancellation(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first loop this hung (a fresh clone's `make test`, test_engine_host_startup): cancelled without
    ``leaving``, it went on beating."""
    in_call = asyncio.Event()
    monkeypatch.setattr(EngineRegistry, "heartbeat", swallowing(EngineRegistry.heartbeat, in_call))
    stopped = False

    def stop() -> None:
        nonlocal stopped
        stopped = True

    record = EngineRecord("swallowed-0", "http://127.0.0.1:1", "m", 32, 100, 2048)
    task = asyncio.create_task(heartbeat_loop(redis_url, 0.05, ModelInfo("m", "tok", 2048, 32), lambda: True,
                                              lambda: record, lambda: stopped))
    await cancelled_while_in_call(task, in_call, stop)


async def test_the_settlers_timer_ends_though_a_pass_swallowed_its_cancellation(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    redis, wire = connect(redis_url, timeout_s=5.0), RedisWire(redis_url, timeout_s=5.0)
    admission = Admission(redis, lease_ttl_s=30.0, wire=wire)
    in_call = asyncio.Event()
    monkeypatch.setattr(admission, "any_due", swallowing(admission.any_due, in_call))
    task = asyncio.create_task(Settler(redis, admission, interval_s=0.05, grace_s=0.0).run())
    try:
        await cancelled_while_in_call(task, in_call, sleeps_raising(monkeypatch))
    finally:
        monkeypatch.undo()
        await wire.close()
        await redis.aclose()


async def test_the_usage_recorder_ends_though_a_flush_swallowed_its_cancellation_and_writes_what_waits(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = UsageRecorder(RecorderConfig(flush_interval_s=0.05, record_ttl_s=60))
    request_ids = [f"t-{uuid.uuid4().hex[:8]}/cmpl-{i}" for i in range(2)]
    recorder.add(UsageRecord(request_ids[0], 10, 2))
    in_call = asyncio.Event()
    real_flush = UsageRecorder.flush
    monkeypatch.setattr(UsageRecorder, "flush", swallowing(real_flush, in_call))
    task = asyncio.create_task(recorder.run(redis_url))
    await asyncio.wait_for(in_call.wait(), 10)
    recorder.add(UsageRecord(request_ids[1], 20, 4))  # ended while the flush's reply was in flight
    monkeypatch.setattr(UsageRecorder, "flush", real_flush)  # the flush in flight still swallows
    try:
        await cancelled_while_in_call(task, in_call, sleeps_raising(monkeypatch))
    finally:
        monkeypatch.undo()
    redis = connect(redis_url, timeout_s=5.0)
    try:  # the last flush on the way out wrote the record that ended meanwhile: nothing lost
        for request_id, tokens in zip(request_ids, [(10, 2), (20, 4)], strict=True):
            assert parse_usage(await redis.hgetall(usage_record_key(request_id))) == [tokens]
    finally:
        await redis.aclose()


async def test_a_kv_event_feed_ends_though_an_apply_swallowed_its_cancellation(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    redis = connect(redis_url, timeout_s=5.0)
    index = PrefixIndex(redis)
    in_call = asyncio.Event()
    monkeypatch.setattr(index, "apply", swallowing(index.apply, in_call))
    stop_batches = asyncio.Event()

    async def batches() -> AsyncIterator[DecodedBatch]:
        yield DecodedBatch(seq=0, ts=0.0, ops=[("store", 1234)])
        await stop_batches.wait()  # no further batch comes: a feed that went on waits here

    task = asyncio.create_task(feed_index(index, f"t-{uuid.uuid4().hex[:8]}", batches()))
    try:
        await cancelled_while_in_call(task, in_call, stop_batches.set)
    finally:
        await redis.aclose()


async def test_the_simulated_fleets_heartbeat_ends_though_a_beat_swallowed_its_cancellation(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = FleetRedis(redis_url, [], [ModelInfo("m", "tok", 2048, 32)], heartbeat_interval_s=0.05)
    in_call = asyncio.Event()
    monkeypatch.setattr(fleet, "_in_batches", swallowing(fleet._in_batches, in_call))
    task = asyncio.create_task(fleet.heartbeat())
    try:
        await cancelled_while_in_call(task, in_call, sleeps_raising(monkeypatch))
    finally:
        monkeypatch.undo()
        await fleet.close()


async def test_a_kv_event_feed_started_after_its_preparation_swallowed_a_cancellation_ends_at_once(
        redis_url: str) -> None:
    """The engine host prepares the index (Redis calls, prepare_index) and then feeds it in the same task: a
    cancellation the preparation swallowed ends the feed before it waits for a first batch that may never come."""
    redis = connect(redis_url, timeout_s=5.0)
    in_call = asyncio.Event()
    stop_batches = asyncio.Event()

    async def batches() -> AsyncIterator[DecodedBatch]:
        await stop_batches.wait()
        yield DecodedBatch(seq=0, ts=0.0, ops=[])

    async def prepared_then_fed() -> None:
        await swallowing(asyncio.sleep, in_call)(0)  # the preparation's last Redis call
        await feed_index(PrefixIndex(redis), f"t-{uuid.uuid4().hex[:8]}", batches())

    task = asyncio.create_task(prepared_then_fed())
    try:
        await cancelled_while_in_call(task, in_call, stop_batches.set)
    finally:
        await redis.aclose()
