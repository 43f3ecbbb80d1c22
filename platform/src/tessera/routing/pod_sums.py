"""The pod table's rows (pod_in_flight.py) summed per engine for one routing decision.

Every decision of a worker in a pod with several workers reads every row, since the other workers' counts change
without telling it. With a few dozen entries a Python loop over them is cheapest; at 1,000 engines with a quarter
of them in flight from two workers it walked ~500 entries, ~0.55 µs each, and the policy then walked the ~400
engines it returned (docs/routing.md, "Latest run": the pod's sums). From ``VECTOR_FROM_ENTRIES`` entries on, the
rows are summed with numpy over the table's memory (~22 µs and ~0.13 µs an entry), and either way a decision gets
only the engines whose pod count exceeds their heartbeat's load: below it no policy's view changes (every policy
reads max(heartbeat, in flight), local_loads.py), so the policy walks a handful.

Both ways give the same sums, in the same float order (entries in row order), tested on random tables
(tests/unit/routing/test_pod_sums.py).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import numpy as np
import numpy.typing as npt

INTS_PER_ENTRY = 4
WRAP = 1 << 32
HALF = 1 << 31
# Entries (all rows together) from which a decision sums the rows with numpy rather than a Python loop: on the
# 2-vCPU VM (2026-12-06, a slow hour) the loop cost ~0.5 µs an entry, numpy ~22 µs and ~0.13 µs
# an entry (the two level at ~56 entries; 500 entries: 258 against 87 µs).
VECTOR_FROM_ENTRIES = 64

_V = TypeVar("_V", int, float)
_D = TypeVar("_D")


def engine_key(engine_id: str) -> int:
    """The 32-bit key an engine's entries carry (signed, as the row's ints are)."""
    return signed32(zlib.crc32(engine_id.encode()))


def signed32(value: int) -> int:
    """``value`` modulo 2**32, as a signed 32-bit int (what a row's ints hold)."""
    return (value + HALF) % WRAP - HALF


class PodTotals(NamedTuple):
    """The pod's view of its engines: requests in flight where they exceed the engine's heartbeat load, prompt
    tokens awaiting their first token, and seconds until those should be prefilled (engines with none left out
    of each)."""

    requests: dict[str, int]
    tokens: Mapping[str, int]
    waits: Mapping[str, float]


class PodEngines:
    """A registry read's engines as the sums need them, built at the read (off the request path): entry key ->
    engine id, and each engine's heartbeat load. Two ids with one key (a CRC-32 collision) count as the later one,
    both ways."""

    __slots__ = ("by_key", "heartbeat", "ids", "keys", "loads", "position")

    def __init__(self, engine_ids: Iterable[str], heartbeat_loads: Mapping[str, int] | None = None) -> None:
        loads = heartbeat_loads or {}
        self.by_key: dict[int, str] = {engine_key(engine_id): engine_id for engine_id in engine_ids}
        self.heartbeat: dict[str, int] = {engine_id: loads.get(engine_id, 0) for engine_id in self.by_key.values()}
        keys = sorted(self.by_key)
        self.keys: npt.NDArray[np.int32] = np.array(keys, dtype=np.int32)
        self.ids: list[str] = [self.by_key[key] for key in keys]  # by position in ``keys``
        self.position: dict[str, int] = {engine_id: i for i, engine_id in enumerate(self.ids)}
        # float, as the sums bincount makes: compared without a cast per decision
        self.loads: npt.NDArray[np.float64] = np.array([self.heartbeat[i] for i in self.ids], dtype=np.float64)


def sum_walked(rows: Sequence[memoryview], counts: Sequence[int], engines: PodEngines, now: int) -> PodTotals:
    """The rows' ``counts[r]`` entries summed by a Python loop; ``now``: the reader's stamp (``_stamp``)."""
    by_key, heartbeat = engines.by_key, engines.heartbeat
    requests: dict[str, int] = {}
    tokens: dict[str, int] = {}
    waits: dict[str, float] = {}
    for row, n in zip(rows, counts, strict=True):
        if n <= 0:
            continue
        it = iter(row[1:1 + n * INTS_PER_ENTRY].tolist())
        for key, num_requests, num_tokens, prefilled_at in zip(it, it, it, it, strict=True):
            engine_id = by_key.get(key)
            if engine_id is None:
                continue
            if num_requests > 0:
                requests[engine_id] = requests.get(engine_id, 0) + num_requests
            if num_tokens > 0:
                tokens[engine_id] = tokens.get(engine_id, 0) + num_tokens
                if prefilled_at and (left := (prefilled_at - now + HALF) % WRAP - HALF) > 0:
                    waits[engine_id] = waits.get(engine_id, 0.0) + left / 1e6
    above = {engine_id: num for engine_id, num in requests.items() if num > heartbeat.get(engine_id, 0)}
    return PodTotals(above, tokens, waits)


def sum_vectorized(table: npt.NDArray[np.int32], counts: Sequence[int], engines: PodEngines,
                   now: int) -> PodTotals:
    """The same sums with numpy: ``table`` is the rows as one (rows, row ints) array over the table's memory. The
    tokens and waits stay arrays, read per engine when asked (``SumsByEngine``): a decision reads a handful."""
    parts = [table[r, 1:1 + n * INTS_PER_ENTRY] for r, n in enumerate(counts) if n > 0]
    keys = engines.keys
    if not parts or not len(keys):
        return PodTotals({}, {}, {})
    # ndarray methods and ufuncs, not numpy's module functions: those add a Python frame each (a few µs a decision).
    entries = np.concatenate(parts).reshape(-1, INTS_PER_ENTRY)
    position = np.minimum(keys.searchsorted(entries[:, 0]), len(keys) - 1)
    known = keys[position] == entries[:, 0]
    if not np.logical_and.reduce(known):  # entries of engines gone from the registry
        position, entries = position[known], entries[known]
    size = len(keys)
    requests = np.bincount(position, weights=np.maximum(entries[:, 1], 0), minlength=size)
    num_tokens = entries[:, 2]
    tokens = np.bincount(position, weights=np.maximum(num_tokens, 0), minlength=size)
    prefilled_at = entries[:, 3].astype(np.int64)
    left = (prefilled_at - now + HALF) % WRAP - HALF
    waiting = (num_tokens > 0) & (prefilled_at != 0) & (left > 0)
    # Each entry's wait in seconds, then summed: the walk's float additions, in its order.
    waits = np.bincount(position[waiting], weights=left[waiting] / 1e6, minlength=size)
    ids = engines.ids
    above = (requests > engines.loads).nonzero()[0].tolist()
    return PodTotals(dict(zip(map(ids.__getitem__, above), map(int, requests[above].tolist()), strict=True)),
                     SumsByEngine(tokens, engines, int), SumsByEngine(waits, engines, float))


class SumsByEngine(Mapping[str, _V]):
    """Per-engine sums kept as an array (positions as ``PodEngines.keys``), an engine's read when asked; engines
    whose sum is not above 0 are absent, as from the walk's dicts."""

    __slots__ = ("_cast", "_engines", "_values")

    def __init__(self, values: npt.NDArray[Any], engines: PodEngines, cast: Callable[[float], _V]) -> None:
        self._values = values  # float64: bincount's sums
        self._engines = engines
        self._cast: Callable[[float], _V] = cast

    def get(self, key: str, default: _V | _D | None = None) -> _V | _D | None:  # type: ignore[override]
        position = self._engines.position.get(key)
        if position is None:
            return default
        value = float(self._values[position])
        return self._cast(value) if value > 0 else default

    def __getitem__(self, key: str) -> _V:
        value = self.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.get(key) is not None

    def __iter__(self) -> Iterator[str]:
        ids = self._engines.ids
        return iter([ids[i] for i in np.flatnonzero(self._values > 0).tolist()])

    def __len__(self) -> int:
        return int(np.count_nonzero(self._values > 0))
