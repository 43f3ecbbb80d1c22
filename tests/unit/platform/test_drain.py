"""The drain's order and bounds (engine/drain.py), on a made-up clock: the registry is left before any wait,
the replica keeps accepting for the registry's max age, an open request is waited for, and the deadline
wins over a request that never ends. A real replica drains on a Ray cluster in tests/integration/ray."""

from __future__ import annotations

import asyncio

from tessera.engine.drain import drain


class Replica:
    """What the drain sees of a replica: its open requests over (made-up) time, and when it left."""

    def __init__(self, open_until: dict[int, float]) -> None:
        self.now = 0.0
        self.open_until = open_until  # request -> time it finishes
        self.left_at: float | None = None
        self.open_seen_before_leaving: int | None = None

    def clock(self) -> float:
        self.now += 0.5  # each look at the clock is half a second later
        return self.now

    def num_open(self) -> int:
        return sum(1 for end in self.open_until.values() if end > self.now)

    async def leave_registry(self) -> None:
        self.left_at = self.now


def run(replica: Replica, max_age_s: float, timeout_s: float) -> tuple[int, float]:
    outcome = asyncio.run(drain(replica.num_open, replica.leave_registry, max_age_s, timeout_s,
                                clock=replica.clock, poll_s=0))
    return outcome.num_cut, outcome.waited_s


def test_idle_replica_leaves_the_registry_first_and_stays_for_the_registry_max_age() -> None:
    replica = Replica({})
    num_cut, waited_s = run(replica, max_age_s=2.0, timeout_s=60)
    assert replica.left_at == 0.5  # before the first wait
    assert num_cut == 0 and waited_s == 2.0  # a gateway's registry copy may still route here until then


def test_open_stream_is_waited_for_until_it_ends() -> None:
    replica = Replica({1: 7.0, 2: 3.0})
    num_cut, waited_s = run(replica, max_age_s=1.0, timeout_s=60)
    assert num_cut == 0
    assert replica.now >= 7.0 and waited_s == replica.now - 0.5


def test_a_request_routed_from_a_stale_registry_copy_is_waited_for_too() -> None:
    # Arrives at 1.5 s (the gateway's copy predates the deregistration), ends at 4 s.
    replica = Replica({})
    real_num_open = replica.num_open

    def num_open() -> int:
        if replica.now >= 1.5:
            replica.open_until.setdefault(9, 4.0)
        return real_num_open()

    outcome = asyncio.run(drain(num_open, replica.leave_registry, 2.0, 60, clock=replica.clock, poll_s=0))
    assert outcome.drained and replica.now >= 4.0


def test_deadline_cuts_a_stream_that_does_not_end() -> None:
    replica = Replica({1: 1000.0})
    num_cut, waited_s = run(replica, max_age_s=1.0, timeout_s=10)
    assert num_cut == 1 and waited_s == 10.0


def test_deadline_shorter_than_the_registry_max_age_bounds_the_drain() -> None:
    replica = Replica({})
    num_cut, waited_s = run(replica, max_age_s=30.0, timeout_s=3)
    assert num_cut == 0 and waited_s == 3.0
