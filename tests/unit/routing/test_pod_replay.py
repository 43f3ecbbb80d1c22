"""A pod worker's replay of another worker's change records (routing/pod_replay.py): the C step and its Python
twin leave every dict of the view equal, record streams and ring ends alike; both apply nothing and say so where
the writer came round to the records while they were copied; the C step refuses arguments that are not a row."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tessera.routing import pod_replay
from tessera.routing.pod_view import INTS_PER_ENTRY, WRAP, PodEngines, PodView, engine_key, signed32

native = pytest.mark.skipif(pod_replay.NATIVE_REPLAY is None, reason="the C replay is not built")

LOG_AT, LOG_RECORDS, WRITTEN_AT = 4, 64, 2  # a small ring: the streams below go round it many times
ENGINES = [f"engine-{i}" for i in range(12)]


class Ring:
    """A writer's row as pod_in_flight lays it out, cut down: a header and a ring of records, nothing else."""

    def __init__(self, written: int = 0) -> None:
        self.ints = memoryview(bytearray(4 * (LOG_AT + LOG_RECORDS * INTS_PER_ENTRY))).cast("i")
        self.ints[WRITTEN_AT] = signed32(written)

    @property
    def written(self) -> int:
        return self.ints[WRITTEN_AT] % WRAP

    def write(self, key: int, requests: int, tokens: int, at: int) -> None:
        base = LOG_AT + (self.written % LOG_RECORDS) * INTS_PER_ENTRY
        self.ints[base:base + INTS_PER_ENTRY] = memoryview(bytearray(16)).cast("i")
        for offset, value in enumerate((key, requests, tokens, at)):
            self.ints[base + offset] = value
        self.ints[WRITTEN_AT] = signed32(self.written + 1)


def view_state(view: PodView) -> dict[str, Any]:
    """Every dict the view keeps, as plain copies."""
    return {"rows": [dict(entries) for entries in view._rows], "requests": dict(view._requests),
            "tokens": dict(view._tokens), "stamps": {k: dict(v) for k, v in view._stamps.items()},
            "above": dict(view.requests_above), "tokens_by_id": dict(view.tokens),
            "waiting": {k: dict(v) for k, v in view._waiting.items()}}


def python_view(num_rows: int) -> PodView:
    view = PodView(num_rows)
    view._native_replay = None
    return view


def random_record(rng: random.Random, keys: list[int]) -> tuple[int, int, int, int]:
    """An entry's whole state, as writers leave them: mostly small counts, zeros (the entry gone), a stamp or none,
    and now and then a negative count (a transient of the writer's updates)."""
    key = rng.choice(keys)
    if rng.random() < 0.2:
        return key, 0, 0, 0
    requests = rng.choice((-1, 0, 1, 2, 3, 5))
    tokens = rng.choice((-100, 0, 0, 300, 2_000))
    at = rng.choice((0, 1, -5, 123_456, signed32(2**32 - 7)))
    return key, requests, tokens, at


@native
def test_c_and_python_replays_leave_every_dict_equal_through_random_streams_and_registry_reads() -> None:
    """Three rows' records at random, replayed in batches of 1 to 40 (straddling the ring's end), with registry
    reads between that change heartbeats and drop engines (and a key no engine has), by each implementation
    into its own view: after every batch the views are equal in every dict."""
    rng = random.Random(11)
    keys = [engine_key(e) for e in ENGINES] + [12345]
    c_view, py_view = PodView(3), python_view(3)
    assert c_view._native_replay is not None
    rings = [Ring(written=rng.choice((0, 2**32 - 30))) for _ in range(3)]
    cursors = [ring.written for ring in rings]
    for round_number in range(400):
        if round_number % 50 == 0:
            listed = rng.sample(ENGINES, rng.randrange(6, len(ENGINES) + 1))
            engines = PodEngines(listed, {e: rng.randrange(3) for e in listed})
            c_view.use(engines)
            py_view.use(engines)
        row = rng.randrange(3)
        ring = rings[row]
        for _ in range(rng.randint(1, 40)):
            ring.write(*random_record(rng, keys))
        behind = (ring.written - cursors[row]) % WRAP
        for view in (c_view, py_view):
            assert view.replay(row, ring.ints, LOG_AT, LOG_RECORDS, WRITTEN_AT, cursors[row], behind)
        cursors[row] = ring.written
        assert view_state(c_view) == view_state(py_view)
    assert view_state(c_view)["requests"]  # the streams left something to compare


@pytest.mark.parametrize("impl", [pytest.param("c", marks=native), "python"])
def test_a_writer_that_came_round_to_the_records_during_the_copy_makes_replay_apply_none(impl: str) -> None:
    """The caller read the count, then the writer wrote a whole ring more before the copy: the records at the
    cursor are overwritten (the copy may be torn), so the replay returns False and leaves the view as it was."""
    view = PodView(2) if impl == "c" else python_view(2)
    view.use(PodEngines(ENGINES))
    ring = Ring(written=2**32 - 3)  # and the count wraps on the way
    key = engine_key(ENGINES[0])
    ring.write(key, 1, 100, 5)
    cursor = ring.written
    ring.write(key, 2, 100, 5)
    behind = (ring.written - cursor) % WRAP
    before = view_state(view)
    for _ in range(LOG_RECORDS):
        ring.write(key, 9, 9, 9)
    assert view.replay(1, ring.ints, LOG_AT, LOG_RECORDS, WRITTEN_AT, cursor, behind) is False
    assert view_state(view) == before
    # One short of a lap the records are whole: applied.
    cursor = ring.written
    for _ in range(LOG_RECORDS - 1):
        ring.write(key, 3, 0, 0)
    assert view.replay(1, ring.ints, LOG_AT, LOG_RECORDS, WRITTEN_AT, cursor, LOG_RECORDS - 1) is True
    assert dict(view.totals(0).requests) == {ENGINES[0]: 3}


@native
def test_the_c_replay_refuses_what_is_not_a_row_and_its_ring() -> None:
    view = PodView(2)
    replay = pod_replay.NATIVE_REPLAY
    assert replay is not None
    ring = Ring()
    ring.write(engine_key(ENGINES[0]), 1, 0, 0)
    state = view._replay_state
    good: list[Any] = [ring.ints, LOG_AT, LOG_RECORDS, WRITTEN_AT, 0, 1, 1, view._rows[1], state]
    for position, bad, error in (
            (0, memoryview(bytearray(8)).cast("i"), ValueError),  # too short to hold the ring
            (0, memoryview(bytearray(4 * (LOG_AT + LOG_RECORDS * 4))).cast("h"), ValueError),  # not 32-bit ints
            (0, "not a buffer", TypeError),
            (2, 0, ValueError),  # an empty ring
            (3, 10**6, ValueError),  # the count outside the row
            (4, 2**32, ValueError),  # a cursor past 32 bits
            (5, 0, ValueError),  # nothing behind
            (5, LOG_RECORDS, ValueError),  # a whole ring behind: the caller copies the row instead
            (7, [], TypeError),
            (8, state[:-1], TypeError),
            (8, (*state[:-1], []), TypeError)):
        args = list(good)
        args[position] = bad
        with pytest.raises(error):
            replay(*args)
    assert view_state(view)["requests"] == {}
    assert replay(*good) is True
    assert view_state(view)["requests"] == {engine_key(ENGINES[0]): 1}
