"""The requests a gateway pod has in flight to each engine, and their prompt tokens still to prefill there,
shared by the pod's worker processes.

Why: a worker's router counts what it sent to each engine until it ends (``router.InFlight``), which is fresher
than the engines' heartbeats (up to a second old). With W workers each sees 1/W of the pod's traffic, so two
workers meeting the same new prefix pick homes from different views, and a long cold prompt queued by one
worker is invisible to the other. At 64 simulated engines overloaded (docs/routing.md, "The pod's in-flight
table"), two workers that each counted alone reached TTFT p99 214-226 ms; sharing the counts, 160-169 ms.

Layout: one file, mapped by every worker, made by ``launch.run_gateway`` before the workers start (``create``),
with one row per worker. A worker owns a row for its life: an ``fcntl`` lock on the row's bytes, which the
kernel drops when the process dies, however it dies. It writes only its own row (no two processes ever write
the same bytes, so no atomics are needed) and reads every row. A row is a header (entry count, generation,
records written), a ring of ``LOG_RECORDS`` change records, and up to ``ROW_ENTRIES`` entries, each entry and
record four 32-bit ints: (engine key, requests, prefill tokens, prefilled at). The key is the engine id's CRC-32,
mapped back to the id by the reader's engine list. *Prefilled at* is when the worker's prompts there should all
be prefilled (routing/prefill_clock.py), in microseconds of CLOCK_MONOTONIC (one clock for the host's processes)
modulo 2**32: a reader takes the difference to its own now modulo 2**32 too, which is right while the two are
within ~35 minutes of each other (a prefill queue is seconds long), and sums the rows' remainders into the
engine's wait. 0 means none.

Every change to an entry is also written to the ring as the entry's new state, then counted in the header, so a
reader applies only what changed since its last decision to its own sums (pod_view.py) instead of summing every
entry each time. A reader that finds it fell a whole ring behind, or the row's generation changed (a new owner),
copies the row's entries and replays the ring from before the copy. A replacement worker takes the row its dead
predecessor left (the only unlocked one), zeroes it and moves its generation on, so a killed worker's counts
last until uvicorn replaces it.

Readers do not lock: a read that races a write can see an entry half-updated or one entry twice for a moment.
That costs a routing decision a wrong load, never a request its answer, and the next record sets it right.
"""

from __future__ import annotations

import fcntl
import mmap
import os
from pathlib import Path

from tessera.routing.pod_view import INTS_PER_ENTRY, WRAP, PodEngines, PodTotals, PodView, engine_key, signed32

ENV_VAR = "TESSERA_POD_IN_FLIGHT"
# Engines a worker can count at once (a row's entries). Beyond it, a request to another engine goes uncounted
# (that engine's heartbeat load still counts): 4,096 engines with requests in flight from one worker.
ROW_ENTRIES = 4096
# Change records a row keeps (a power of two: the written count wraps at 2**32). A request makes three (sent,
# first token, ended); a reader more than this many behind a writer copies the row instead (O(its entries)).
LOG_RECORDS = 4096
# Header ints: the entry count, the row's generation (moved on by each new owner and at close), and the records
# written (modulo 2**32), then one spare for alignment.
_COUNT, _GENERATION, _WRITTEN = 0, 1, 2
_HEADER_INTS = 4
_LOG_AT = _HEADER_INTS
_ENTRIES_AT = _LOG_AT + LOG_RECORDS * INTS_PER_ENTRY
_ROW_INTS = _ENTRIES_AT + ROW_ENTRIES * INTS_PER_ENTRY
ROW_BYTES = 4 * _ROW_INTS
# Tries a reader makes at catching a row up before it settles for what it has (a writer lapping it each time).
_CATCH_UP_TRIES = 3

# Rows claimed by this process: fcntl locks are per process, so a second attach in the same process (a bench's
# two routers) would otherwise take a row the first holds.
_claimed_here: set[tuple[str, int]] = set()


def create(path: Path, num_rows: int) -> None:
    """A zeroed table of ``num_rows`` rows at ``path`` (replacing any earlier one): call before any worker
    attaches."""
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.truncate(num_rows * ROW_BYTES)
    os.replace(tmp, path)


class PodInFlight:
    """This worker's row of the pod's table, and its view of every row (pod_view.py)."""

    def __init__(self, fd: int, view: mmap.mmap, row: int, num_rows: int, claim: tuple[str, int]) -> None:
        self._fd = fd
        self._map = view
        self._ints = memoryview(view).cast("i")
        self._rows = [self._ints[r * _ROW_INTS:(r + 1) * _ROW_INTS] for r in range(num_rows)]
        self._own = self._rows[row]
        self.row = row
        self._claim = claim
        self._others = [r for r in range(num_rows) if r != row]
        self._view = PodView(num_rows)
        # Per row: the generation and the records written as this worker last applied them (None: never read).
        self._generations: list[int | None] = [None] * num_rows
        self._cursors = [0] * num_rows
        # engine id -> its entry's index in this worker's row
        self._positions: dict[str, int] = {}
        self._engine_ids: list[str] = []  # by entry index
        self._keys: list[int] = []  # by entry index

    @classmethod
    def attach(cls, path: Path) -> PodInFlight | None:
        """Claims a free row of the table at ``path``, zeroes it and reads every other row; None when every row is
        held."""
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        num_rows = size // ROW_BYTES
        for row in range(num_rows):
            claim = (str(path.resolve()), row)
            if claim in _claimed_here:
                continue
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, ROW_BYTES, row * ROW_BYTES)
            except OSError:
                continue  # a live worker's
            _claimed_here.add(claim)
            table = cls(fd, mmap.mmap(fd, num_rows * ROW_BYTES), row, num_rows, claim)
            table._clear_own()  # what a dead predecessor left
            for other in table._others:
                table._copy_row(other)
            return table
        os.close(fd)
        return None

    @classmethod
    def private(cls) -> PodInFlight:
        """A table of one row in this process's memory alone, no file and no lock: a one-worker gateway's counts,
        kept and read as a pod worker's are (no ring: no other process reads it)."""
        return cls(-1, mmap.mmap(-1, ROW_BYTES), 0, 1, ("", -1))

    def add(self, engine_id: str, requests: int, tokens: int, prefilled_at_s: float | None = None) -> None:
        """Adds to this worker's counts for ``engine_id`` (negative to take away), and with ``prefilled_at_s`` sets
        when its prompts there should all be prefilled (``time.monotonic()`` seconds; 0.0: not known) in the same
        record. An engine without an entry here gets one only for a positive count (nothing to record else)."""
        own = self._own
        position = self._positions.get(engine_id)
        if position is None:
            if requests <= 0 and tokens <= 0:
                return
            position = len(self._engine_ids)
            if position == ROW_ENTRIES:
                return  # the row is full: this engine counts in the worker's own view only
            key = engine_key(engine_id)
            at = 0 if prefilled_at_s is None else _stamp_or_none(prefilled_at_s)
            base = _ENTRIES_AT + position * INTS_PER_ENTRY
            own[base] = key
            own[base + 1] = requests
            own[base + 2] = tokens
            own[base + 3] = at
            self._positions[engine_id] = position
            self._engine_ids.append(engine_id)
            self._keys.append(key)
            own[_COUNT] = position + 1  # published once the entry is whole
            self._record(key, requests, tokens, at)
            return
        base = _ENTRIES_AT + position * INTS_PER_ENTRY
        left_requests = own[base + 1] + requests
        left_tokens = own[base + 2] + tokens
        at = own[base + 3] if prefilled_at_s is None else _stamp_or_none(prefilled_at_s)
        if left_requests > 0 or left_tokens > 0:
            own[base + 1] = left_requests
            own[base + 2] = left_tokens
            own[base + 3] = at
            self._record(self._keys[position], left_requests, left_tokens, at)
            return
        # Nothing left there: the row's last entry takes this one's place, so a row holds only the engines
        # this worker has requests at, and a reader copying it copies no more than that. Key first, then its
        # counts: a copy in between sees the moved engine with this one's zeros, and both records below, which
        # come after the copy, set it right.
        key = self._keys[position]
        last = len(self._engine_ids) - 1
        moved = self._engine_ids.pop()
        moved_key = self._keys.pop()
        del self._positions[engine_id]
        if position != last:
            source = _ENTRIES_AT + last * INTS_PER_ENTRY
            own[base:base + INTS_PER_ENTRY] = own[source:source + INTS_PER_ENTRY]
            self._engine_ids[position] = moved
            self._keys[position] = moved_key
            self._positions[moved] = position
        own[_COUNT] = last
        self._record(key, 0, 0, 0)
        if position != last:
            self._record(moved_key, own[base + 1], own[base + 2], own[base + 3])

    def _record(self, key: int, requests: int, tokens: int, at: int) -> None:
        """An entry's new state: into this worker's own sums, then the ring, then counted (readers read the
        count first, so they never apply a record before it is whole)."""
        self._view.set(self.row, key, requests, tokens, at)
        if self._fd < 0:
            return  # a private table (``private()``): no other process reads its ring
        own = self._own
        written = own[_WRITTEN]
        base = _LOG_AT + (written % LOG_RECORDS) * INTS_PER_ENTRY
        own[base] = key
        own[base + 1] = requests
        own[base + 2] = tokens
        own[base + 3] = at
        own[_WRITTEN] = signed32(written + 1)

    def use(self, engines: PodEngines) -> None:
        """The engines of a registry read, for the sums by id from now on (O(engines in flight)): called at the
        read, off the request path, so the next decision does not pay for it."""
        if engines is not self._view.engines:
            self._view.use(engines)

    def totals(self, engines: PodEngines, now_s: float) -> PodTotals:
        """The pod's requests (where above the engine's heartbeat load), prefill tokens and prefill wait (seconds
        from ``now_s``, a ``time.monotonic()`` reading) per engine, every row summed, for the engines of
        ``engines`` (the last registry read's); entries of engines it lacks (gone from the registry) are
        skipped. The other rows' changes since the last call are applied first."""
        view = self._view
        if engines is not view.engines:
            view.use(engines)
        for row in self._others:
            self._catch_up(row)
        return view.totals(_stamp(now_s))

    def _catch_up(self, row: int) -> None:
        """Applies row ``row``'s records written since the last call, or copies the row where they are lost."""
        ints = self._rows[row]
        for _ in range(_CATCH_UP_TRIES):
            if ints[_GENERATION] != self._generations[row]:
                self._copy_row(row)
            cursor = self._cursors[row]
            written = ints[_WRITTEN] % WRAP
            behind = (written - cursor) % WRAP
            if not behind:
                return
            if behind >= LOG_RECORDS:
                self._copy_row(row)
                continue
            if not self._view.replay(row, ints, _LOG_AT, LOG_RECORDS, _WRITTEN, cursor, behind):
                self._copy_row(row)  # the writer came round to them while they were copied
                continue
            self._cursors[row] = written
            return

    def _copy_row(self, row: int) -> None:
        """Row ``row``'s entries as they read now, with the records from before the copy still to replay over
        them (the records are whole states, so one the copy already holds changes nothing)."""
        ints = self._rows[row]
        self._generations[row] = ints[_GENERATION]
        self._cursors[row] = ints[_WRITTEN] % WRAP
        count = max(0, min(ints[_COUNT], ROW_ENTRIES))
        copied = ints[_ENTRIES_AT:_ENTRIES_AT + count * INTS_PER_ENTRY].tolist()
        it = iter(copied)
        self._view.replace_row(row, zip(it, it, it, it, strict=True))

    def _clear_own(self) -> None:
        """Zeroes this worker's row and moves its generation on: readers copy it afresh."""
        own = self._own
        generation = own[_GENERATION]
        own[:] = memoryview(bytes(ROW_BYTES)).cast("i")
        own[_GENERATION] = signed32(generation + 1)
        self._view.replace_row(self.row, ())

    def close(self) -> None:
        """Releases the row (its counts zeroed first) and the mapping."""
        self._clear_own()
        for row in self._rows:
            row.release()
        self._own.release()
        self._ints.release()
        self._map.close()
        if self._fd >= 0:  # a table's file (``private()`` has none)
            os.close(self._fd)  # drops this process's lock on the row
        _claimed_here.discard(self._claim)


def _stamp(at_s: float) -> int:
    """``at_s`` (monotonic seconds) in microseconds, as a row holds it (``signed32``)."""
    return signed32(int(at_s * 1e6))


def _stamp_or_none(at_s: float) -> int:
    """A prefilled-at stamp: 0 (none) for ``at_s`` 0.0 (not known)."""
    return _stamp(at_s) if at_s > 0 else 0


def attach_from_env() -> PodInFlight | None:
    """The table ``launch.run_gateway`` made for this pod's workers (``TESSERA_POD_IN_FLIGHT``), or None (one
    worker, or a gateway built in a test)."""
    path = os.environ.get(ENV_VAR)
    if not path or not Path(path).exists():
        return None
    return PodInFlight.attach(Path(path))
