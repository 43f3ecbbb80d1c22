"""Another worker's change records since a reader's cursor, copied out of its ring and applied to the reader's
sums: the step each decision of a pod worker takes for every other row (pod_in_flight.py ``_catch_up``), in C
where built.

Why C: with two workers a pod, each decision finds the other worker's ~4 records of its requests (sent, first
token, ended, a moved entry) and applies them first. In Python that is ~3.2 µs (0.6 µs a ``PodView.set``, the
rest copying them out), in C ~1.1 (``PodInFlight.totals`` with four new records 4.5-4.9 -> 2.5 µs in a loop of its
own). On a 2-vCPU VM that pauses a busy thread ~400 times a second for ~20 µs, a decision meets a pause with a
chance of about its length times their rate, so its p99 is a pause's once its p50 nears 20 µs: the pod's
64-engine decision, p50 22-26 µs in Python, is 19-20 in C (docs/routing.md, "Benchmark of the local index").
The C step (``_pod_replay.c``, built by ``make install`` where a compiler is) copies the records with plain loads
and applies them with the dict API.

Two implementations, one contract: ``PodView._replay_py`` and ``_pod_replay.replay`` copy the records, read the
written count again and apply none if the writer came round to the first of them meanwhile (returning False: the
caller copies the row), else apply each as ``PodView.set`` does and return True. Both leave every dict of the
view equal (tests/unit/routing/test_pod_replay.py). ``TESSERA_NATIVE_POD_VIEW=0`` keeps the Python one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tessera.native_steps import POD_REPLAY_STEP

# replay(ints, log_at, log_records, written_at, cursor, behind, row, entries, state) -> bool
Replay = Callable[[memoryview, int, int, int, int, int, int, dict[int, Any], tuple[dict[Any, Any], ...]], bool]

NATIVE_REPLAY: Replay | None = POD_REPLAY_STEP.load()
