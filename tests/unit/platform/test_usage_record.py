"""The replica's usage records (engine/usage_record.py, engine/protocol.py): keyed by the gateway's request id
whatever the attempt, written in batches, kept when Redis fails (within the bound), and fed by the end of
every request in ``InFlightRequests``."""

from __future__ import annotations

from typing import Any

import pytest

from tessera.engine.in_flight import InFlight, InFlightRequests
from tessera.engine.protocol import RequestStats, base_request_id, parse_usage, usage_record_key
from tessera.engine.usage_record import RecorderConfig, UsageRecord, UsageRecorder


class Pipeline:
    def __init__(self, redis: FakeRedis) -> None:
        self.redis, self.commands = redis, []  # type: ignore[var-annotated]

    def hset(self, key: str, field: str, value: str) -> None:
        self.commands.append(("hset", key, field, value))

    def expire(self, key: str, ttl_s: int) -> None:
        self.commands.append(("expire", key, ttl_s))

    async def execute(self) -> list[Any]:
        if self.redis.down:
            raise ConnectionError("down")
        self.redis.round_trips += 1
        for command in self.commands:
            if command[0] == "hset":
                self.redis.hashes.setdefault(command[1], {})[command[2]] = command[3]
            else:
                self.redis.ttls[command[1]] = command[2]
        return [1] * len(self.commands)


class FakeRedis:
    def __init__(self) -> None:
        self.down = False
        self.round_trips = 0
        self.hashes: dict[str, dict[str, str]] = {}
        self.ttls: dict[str, int] = {}

    def pipeline(self, transaction: bool = True) -> Pipeline:
        return Pipeline(self)


def test_every_attempt_of_a_request_is_recorded_under_the_gateways_id() -> None:
    assert base_request_id("acme/cmpl-abc") == "acme/cmpl-abc"
    assert base_request_id("acme/cmpl-abc-r2") == "acme/cmpl-abc"
    assert base_request_id("acme/cmpl-abc-rx") == "acme/cmpl-abc-rx"  # not an attempt suffix
    assert usage_record_key("acme/cmpl-abc-r1") == usage_record_key("acme/cmpl-abc") == \
        "tessera:engine-usage:acme/cmpl-abc"


def test_a_record_parses_into_its_attempts() -> None:
    assert sorted(parse_usage({b"a": b"20 37", b"a-r1": b"57 3", b"bad": b"x 1"})) == [(20, 37), (57, 3)]


async def test_records_are_written_in_one_round_trip_with_a_ttl() -> None:
    redis, recorder = FakeRedis(), UsageRecorder(RecorderConfig(0.5, 900))
    recorder.add(UsageRecord("acme/c1", 20, 37))
    recorder.add(UsageRecord("acme/c1-r1", 57, 3))
    recorder.add(UsageRecord("acme/c2", 5, 0))
    assert await recorder.flush(redis) == 3 and redis.round_trips == 1
    assert redis.hashes == {"tessera:engine-usage:acme/c1": {"acme/c1": "20 37", "acme/c1-r1": "57 3"},
                            "tessera:engine-usage:acme/c2": {"acme/c2": "5 0"}}
    assert set(redis.ttls.values()) == {900}
    assert await recorder.flush(redis) == 0 and redis.round_trips == 1  # nothing waits: no round trip


async def test_records_wait_for_redis_within_the_bound() -> None:
    redis, recorder = FakeRedis(), UsageRecorder(RecorderConfig(0.5, 900, max_queued=2))
    recorder.add(UsageRecord("acme/c1", 1, 1))
    redis.down = True
    with pytest.raises(ConnectionError):
        await recorder.flush(redis)
    recorder.add(UsageRecord("acme/c2", 2, 2))
    recorder.add(UsageRecord("acme/c3", 3, 3))  # the oldest goes: two wait at most
    redis.down = False
    assert await recorder.flush(redis) == 2
    assert set(redis.hashes) == {"tessera:engine-usage:acme/c2", "tessera:engine-usage:acme/c3"}
    assert recorder.num_dropped == 1


def test_the_end_of_a_request_hands_its_counters_over() -> None:
    ended: list[InFlight] = []
    table = InFlightRequests(ended.append)
    entry = table.start("acme/c1", "acme", 0)
    entry.stats = RequestStats(num_prompt_tokens=20, num_output_tokens=5)
    assert "stats" not in table.listing()[0]  # GET /requests is unchanged
    table.finish("acme/c1")
    table.finish("acme/c1")  # twice: handed over once
    assert [(e.request_id, e.stats.num_output_tokens if e.stats else None) for e in ended] == [("acme/c1", 5)]
