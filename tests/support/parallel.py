"""How `make test` splits the suite between pytest-xdist workers (``--dist loadgroup``).

The suite's time is mostly waiting: vLLM engines starting, streams decoding, Redis and gateway processes
coming up, timers expiring. Two workers overlap those waits; what they must not do is start an expensive
shared fixture twice, or run two Ray clusters at once. So every test gets an ``xdist_group``:

- tests that start Ray (a local cluster, Serve, ``tessera up``) share one group: one cluster at a time, and
  Serve's proxy port is not shared by two;
- tests that use a shared engine fixture (session or package scope) share that fixture's group, so the
  engine starts once, in one worker;
- every other test is grouped with its module (module-scoped fixtures start once).

xdist hands groups out in collection order (``--no-loadscope-reorder``), so the collection is ordered
longest groups first: the long Ray and engine groups start at once on both workers and the many short
unit modules fill in at the end, which keeps the two workers' finishing times close.
"""

from __future__ import annotations

from pathlib import Path

import pytest

RAY_GROUP = "ray"
# Files (besides tests/e2e and tests/integration/ray) whose tests start Ray.
RAY_FILES = frozenset({
    "tests/integration/platform/test_local_redis_data.py",
    "tests/integration/tenancy/test_redis_crash_durability.py",
})
RAY_DIRS = ("tests/e2e/", "tests/integration/ray/")
# Shared engine fixtures (session or package scope) -> the group of every test that uses one.
SHARED_FIXTURE_GROUPS = {
    "tenancy_engine": "tenancy-engine",
    "gateways": "tenancy-engine",
    "fp8_engine": "fp8-engine",
}
# Where groups go in the collection: lower first. Ray and the engine groups are the longest.
_RANK_RAY, _RANK_SHARED, _RANK_INTEGRATION, _RANK_OTHER = 0, 1, 2, 3


def group_of(path: str, fixture_names: list[str]) -> tuple[int, str]:
    """(rank, group) of a test in the file ``path`` (relative to the repository, POSIX separators) that
    uses ``fixture_names``."""
    if path in RAY_FILES or path.startswith(RAY_DIRS):
        return _RANK_RAY, RAY_GROUP
    for name in fixture_names:
        if name in SHARED_FIXTURE_GROUPS:
            return _RANK_SHARED, SHARED_FIXTURE_GROUPS[name]
    rank = _RANK_INTEGRATION if path.startswith("tests/integration/") else _RANK_OTHER
    return rank, path


def assign_groups(items: list[pytest.Item], root: Path) -> None:
    """Marks each item with its xdist group and orders ``items`` by group rank. A module goes whole to one
    group (the first shared fixture any of its tests uses), so its module fixtures set up once; the sort is
    stable, so tests keep their order within a module and a group."""
    paths = {id(item): item.path.relative_to(root).as_posix() for item in items}
    fixtures_of_module: dict[str, list[str]] = {}
    for item in items:
        fixtures_of_module.setdefault(paths[id(item)], []).extend(getattr(item, "fixturenames", ()))
    placement = {path: group_of(path, names) for path, names in fixtures_of_module.items()}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(name=placement[paths[id(item)]][1]))
    items.sort(key=lambda item: placement[paths[id(item)]][0])


__all__ = ["RAY_GROUP", "assign_groups", "group_of"]
