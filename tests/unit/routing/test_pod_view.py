"""A worker's view of the pod's table (routing/pod_view.py, the log of routing/pod_in_flight.py): the sums a reader
keeps from the other rows' change records equal the sums of what every worker wrote, whether the reader followed
each record, fell a whole ring behind, or met a row that changed owner; a record is an entry's whole state, so a
copy caught mid-change is set right by the records after it. Each test runs with the replay in C (where built)
and in Python (routing/pod_replay.py)."""

from __future__ import annotations

import json
import random
import select
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera.routing import pod_in_flight, pod_replay
from tessera.routing.pod_in_flight import LOG_RECORDS, PodInFlight
from tessera.routing.pod_view import PodEngines, PodView, engine_key

ENGINES = [f"engine-{i}" for i in range(40)]
NOW_S = 5_000.0


@pytest.fixture(autouse=True, params=[
    pytest.param("c", marks=pytest.mark.skipif(pod_replay.NATIVE_REPLAY is None, reason="the C replay is not built")),
    "python"])
def replay_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which replay the views made in the test use (a view takes it when made)."""
    if request.param == "python":
        monkeypatch.setattr(pod_replay, "NATIVE_REPLAY", None)
    return str(request.param)


@pytest.fixture
def three(tmp_path: Path) -> Iterator[list[PodInFlight]]:
    path = tmp_path / "pod.table"
    pod_in_flight.create(path, 3)
    pods = [PodInFlight.attach(path) for _ in range(3)]
    assert all(pods)
    yield [pod for pod in pods if pod is not None]
    for pod in pods:
        if pod is not None:
            pod.close()


class Writer:
    """One worker's requests as a router makes them (sent, first token, ended), and what its row should hold."""

    def __init__(self, pod: PodInFlight, rng: random.Random) -> None:
        self.pod, self.rng = pod, rng
        self.flights: list[tuple[str, int]] = []  # (engine, tokens still to prefill)
        self.expected: dict[str, list[float]] = {}  # engine -> [requests, tokens, prefilled at s]

    def step(self) -> None:
        rng = self.rng
        choice = rng.random()
        if choice < 0.4 or not self.flights:
            engine_id, tokens = rng.choice(ENGINES), rng.choice((0, 100, 2_000))
            at_s = NOW_S + rng.uniform(-0.5, 2.0) if tokens else None
            self.pod.add(engine_id, 1, tokens, at_s)
            entry = self.expected.setdefault(engine_id, [0, 0, 0.0])
            entry[0] += 1
            entry[1] += tokens
            if at_s is not None:
                entry[2] = at_s
            self.flights.append((engine_id, tokens))
        elif choice < 0.6:
            i = rng.randrange(len(self.flights))
            engine_id, tokens = self.flights[i]
            if tokens:  # its first token
                at_s = NOW_S + rng.uniform(-0.5, 2.0)
                self.pod.add(engine_id, 0, -tokens, at_s)
                self.expected[engine_id][1] -= tokens
                self.expected[engine_id][2] = at_s
                self.flights[i] = (engine_id, 0)
        else:
            engine_id, tokens = self.flights.pop(self.rng.randrange(len(self.flights)))
            self.pod.add(engine_id, -1, -tokens)
            entry = self.expected[engine_id]
            entry[0] -= 1
            entry[1] -= tokens
            if entry[0] <= 0 and entry[1] <= 0:
                del self.expected[engine_id]


def expected_totals(writers: list[Writer], heartbeat: dict[str, int]) -> tuple[dict[str, int], dict[str, int],
                                                                               dict[str, float]]:
    requests: dict[str, int] = {}
    tokens: dict[str, int] = {}
    waits: dict[str, float] = {}
    for writer in writers:
        for engine_id, (num_requests, num_tokens, at_s) in writer.expected.items():
            if engine_id not in heartbeat:  # gone from the registry: skipped
                continue
            requests[engine_id] = requests.get(engine_id, 0) + int(num_requests)
            if num_tokens > 0:
                tokens[engine_id] = tokens.get(engine_id, 0) + int(num_tokens)
                if at_s > NOW_S:
                    waits[engine_id] = waits.get(engine_id, 0.0) + (at_s - NOW_S)
    above = {engine_id: n for engine_id, n in requests.items() if n > heartbeat.get(engine_id, 0)}
    return above, tokens, waits


def assert_reads(pod: PodInFlight, engines: PodEngines, writers: list[Writer], heartbeat: dict[str, int]) -> None:
    requests, tokens, waits = pod.totals(engines, NOW_S)
    want_requests, want_tokens, want_waits = expected_totals(writers, heartbeat)
    assert dict(requests) == want_requests
    assert dict(tokens) == want_tokens
    assert dict(waits) == pytest.approx(want_waits, abs=1e-5)


def test_every_reader_keeps_the_pods_sums_through_random_traffic_and_ring_laps(three: list[PodInFlight]) -> None:
    """Three workers send, prefill and end requests at random; after bursts of 1 to 3,000 changes (some a whole
    ring and more behind a reader), every worker's view equals the sums of what all three wrote, with heartbeat
    loads that change at registry reads and engines the registry no longer lists."""
    rng = random.Random(7)
    writers = [Writer(pod, rng) for pod in three]
    heartbeat = {engine_id: rng.randrange(3) for engine_id in ENGINES}
    engines = PodEngines(ENGINES, heartbeat)
    lapped = 0
    for round_number in range(300):
        burst = rng.choice((1, 2, 3, 10, 50)) if round_number % 25 else 3_000
        for _ in range(burst):
            rng.choice(writers).step()
        lapped += burst >= LOG_RECORDS // 2
        if round_number % 40 == 39:  # a registry read: new heartbeats, a few engines gone
            heartbeat = {engine_id: rng.randrange(3) for engine_id in ENGINES[:-rng.randrange(4)]}
            engines = PodEngines(heartbeat, heartbeat)
        for pod in rng.sample(three, rng.randrange(1, 4)):
            assert_reads(pod, engines, writers, heartbeat)
    assert lapped >= 10


def test_a_reader_a_whole_ring_behind_copies_the_row(three: list[PodInFlight]) -> None:
    writer, reader, _ = three
    engines = PodEngines(ENGINES)
    writer.add("engine-0", 1, 0)
    assert dict(reader.totals(engines, NOW_S).requests) == {"engine-0": 1}
    for _ in range(LOG_RECORDS):  # the first record the reader has not read is overwritten
        writer.add("engine-1", 1, 0)
        writer.add("engine-1", -1, 0)
    writer.add("engine-2", 3, 0)
    assert dict(reader.totals(engines, NOW_S).requests) == {"engine-0": 1, "engine-2": 3}


def test_a_row_with_a_new_owner_is_copied_afresh_even_where_its_record_count_matches(tmp_path: Path) -> None:
    """A new owner zeroes the row and moves its generation on: a reader whose cursor equals the new owner's count
    of records (the same number written since) would otherwise keep the dead owner's counts."""
    path = tmp_path / "pod.table"
    pod_in_flight.create(path, 2)
    first, reader = PodInFlight.attach(path), PodInFlight.attach(path)
    assert first is not None and reader is not None
    engines = PodEngines(ENGINES)
    first.add("engine-0", 1, 0)
    first.add("engine-1", 1, 0)
    assert dict(reader.totals(engines, NOW_S).requests) == {"engine-0": 1, "engine-1": 1}
    row = first.row
    first.close()
    second = PodInFlight.attach(path)
    assert second is not None and second.row == row
    second.add("engine-5", 2, 0)
    second.add("engine-6", 1, 0)  # two records, as the first owner wrote
    assert dict(reader.totals(engines, NOW_S).requests) == {"engine-5": 2, "engine-6": 1}
    second.close()
    reader.close()


def test_the_written_count_wraps_at_two_to_the_32(three: list[PodInFlight]) -> None:
    writer, reader, _ = three
    engines = PodEngines(ENGINES)
    writer._own[2] = -3  # 2**32 - 3 records written: the count wraps in the next three
    reader.totals(engines, NOW_S)  # a whole ring "behind" from the reader's 0: copies the (empty) row
    for i in range(6):
        writer.add(f"engine-{i}", 1, 0)
    assert writer._own[2] == 3
    assert dict(reader.totals(engines, NOW_S).requests) == {f"engine-{i}": 1 for i in range(6)}


def test_a_removal_that_moves_the_rows_last_entry_records_the_moved_entry_too(three: list[PodInFlight]) -> None:
    """A copy made while the last entry moves into a removed one's place can miss it; the writer records the moved
    entry's state after the removal's, so the replay that follows any copy restores it."""
    writer = three[0]
    for engine_id in ("engine-0", "engine-1", "engine-2"):
        writer.add(engine_id, 1, 50)
    writer.add("engine-0", -1, -50)
    written = writer._own[2]
    records = [tuple(writer._own[4 + 4 * i:8 + 4 * i].tolist()) for i in range(written - 2, written)]
    assert records == [(engine_key("engine-0"), 0, 0, 0), (engine_key("engine-2"), 1, 50, 0)]


def test_a_copy_caught_mid_change_is_set_right_by_the_records_after_it() -> None:
    """The view's side: a copy that lacks an entry or holds a stale one, then the records written since (some the
    copy already held), gives the sums of the row as it is."""
    view = PodView(2)
    engines = PodEngines(["a", "b", "c"])
    view.use(engines)
    key_a, key_b, key_c = (engine_key(e) for e in "abc")
    view.set(1, key_b, 1, 0, 0)  # the other row, unaffected throughout
    # The row really holds b (2, 30) and c (1, 10); the copy saw b stale and missed c (mid-move).
    view.replace_row(0, [(key_a, 1, 5, 0), (key_b, 1, 30, 0)])
    for key, requests, tokens in ((key_a, 0, 0), (key_b, 2, 30), (key_c, 1, 10), (key_b, 2, 30)):
        view.set(0, key, requests, tokens, 0)
    totals = view.totals(0)
    assert dict(totals.requests) == {"b": 3, "c": 1} and dict(totals.tokens) == {"b": 30, "c": 10}
    view.replace_row(0, [])
    assert dict(view.totals(0).requests) == {"b": 1} and dict(view.totals(0).tokens) == {}


WRITER = textwrap.dedent("""
    import json, random, sys
    from pathlib import Path
    from tessera.routing.pod_in_flight import PodInFlight
    pod = PodInFlight.attach(Path(sys.argv[1]))
    assert pod is not None
    rng, flights, state = random.Random(3), [], {}
    print("ready", flush=True)
    for _ in range(int(sys.argv[2])):
        if rng.random() < 0.5 or not flights:
            engine_id = f"engine-{rng.randrange(40)}"
            pod.add(engine_id, 1, 100)
            flights.append(engine_id)
            state[engine_id] = state.get(engine_id, 0) + 1
        else:
            engine_id = flights.pop(rng.randrange(len(flights)))
            pod.add(engine_id, -1, -100)
            state[engine_id] -= 1
    print(json.dumps({k: v for k, v in state.items() if v}), flush=True)
    sys.stdin.read()  # holds the row until told
""")


def test_a_reader_racing_a_writer_in_another_process_ends_with_its_exact_counts(tmp_path: Path) -> None:
    """A real writer process makes 200,000 changes as fast as it can while this process reads the sums in a loop
    (reads that race the writes, rings lapped mid-read); once the writer stops, one more read gives exactly its
    counts."""
    path = tmp_path / "pod.table"
    pod_in_flight.create(path, 2)
    reader = PodInFlight.attach(path)
    assert reader is not None
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), "200000"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "ready"
        engines = PodEngines(ENGINES)
        reads = 0
        while proc.poll() is None and reads < 2_000_000:
            reader.totals(engines, NOW_S)
            reads += 1
            if reads % 500 == 0 and select.select([proc.stdout], [], [], 0)[0]:
                break
        final = json.loads(proc.stdout.readline())
        assert dict(reader.totals(engines, NOW_S).requests) == final
        assert dict(reader.totals(engines, NOW_S).tokens) == {k: 100 * v for k, v in final.items()}
        assert reads > 100
    finally:
        proc.kill()
        proc.wait(timeout=10)
        reader.close()


class LappingRow:
    """A reader's view of a row (the memoryview's item and slice reads) that runs ``lap`` once, right after the
    reader's first slice of the ring: the writer going round the whole ring while the reader is between reads,
    as a reader preempted mid-read would meet it."""

    def __init__(self, ints: memoryview, lap: Callable[[], None]) -> None:
        self._ints, self._lap = ints, lap
        self._lapped = False

    def __getitem__(self, index: int | slice) -> Any:
        value = self._ints[index]
        if isinstance(index, slice) and not self._lapped:
            self._lapped = True
            self._lap()
        return value


def test_a_writer_lapping_the_ring_during_a_read_makes_the_reader_copy_the_row(
        three: list[PodInFlight], replay_impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer goes round the whole ring while the reader copies its records: in Python between the copy's two
    slices (a wrapper of the row's reads), in C between the reader's read of the written count and the copy (the
    C step reads the row's buffer itself, so the lap comes just before it). Either way the reader copies the row."""
    writer, reader, _ = three
    engines = PodEngines(ENGINES)
    for _ in range(LOG_RECORDS - 5):  # the next records straddle the ring's end: read in two slices
        writer.add("engine-0", 1, 0)
        writer.add("engine-0", -1, 0)
    assert dict(reader.totals(engines, NOW_S).requests) == {}
    for i in range(10):
        writer.add(f"engine-{i}", 1, 0)
    lapped: list[bool] = []

    def lap() -> None:
        lapped.append(True)
        for _ in range(LOG_RECORDS // 2):
            writer.add("engine-20", 1, 0)
            writer.add("engine-20", -1, 0)
        writer.add("engine-30", 4, 0)

    ints = reader._rows[writer.row]
    if replay_impl == "python":
        reader._rows[writer.row] = LappingRow(ints, lap)  # type: ignore[call-overload]
    else:
        replay = PodView.replay

        def replay_after_a_lap(view: PodView, *args: Any) -> bool:
            if not lapped:
                lap()
            return replay(view, *args)

        monkeypatch.setattr(PodView, "replay", replay_after_a_lap)
    try:
        requests = dict(reader.totals(engines, NOW_S).requests)
    finally:
        reader._rows[writer.row] = ints
    assert lapped
    assert requests == {**{f"engine-{i}": 1 for i in range(10)}, "engine-30": 4}


def test_a_private_table_counts_without_change_records() -> None:
    """A one-worker gateway's own table: the same sums, and no ring writes (no other process reads them)."""
    loads = PodInFlight.private()
    engines = PodEngines(ENGINES)
    loads.add("engine-0", 1, 100, NOW_S + 0.5)
    loads.add("engine-1", 2, 0)
    requests, tokens, waits = loads.totals(engines, NOW_S)
    assert dict(requests) == {"engine-0": 1, "engine-1": 2} and dict(tokens) == {"engine-0": 100}
    assert waits["engine-0"] == pytest.approx(0.5, abs=2e-6)
    assert loads._own[2] == 0  # records written
    loads.close()
