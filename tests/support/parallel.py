"""How `make test` splits the suite between two pytest-xdist workers.

The suite's time is mostly waiting: vLLM engines starting, streams decoding, Redis and gateway processes
coming up, timers expiring. Two workers overlap those waits; what they must not do is start an expensive
shared fixture twice, or run two Ray clusters at once. So every test module belongs to one group, and a
group runs whole on one worker:

- modules that start Ray (a local cluster, Serve, ``tessera up``) share one group: one cluster at a time,
  and Serve's proxy port is not shared by two;
- modules that use a shared engine fixture (session or package scope) share that fixture's group, so the
  engine starts once, in one worker;
- every other module is a group of its own (its module fixtures start once).

A module's group is read from its path and its source text (the shared fixtures' names), so the controller,
which never imports the tests, and the workers, which collect them, agree on it.

NOTE: xdist's own ``--dist loadgroup`` cannot be used: it renames each test's node id to carry its group,
and pytest 9 no longer lets a plugin rename a node (xdist 3.8 writes an attribute pytest no longer reads), so
every test became a group of its own. ``GroupScheduling`` is xdist's scope scheduler keyed by our groups.

Groups go out in collection order (``--no-loadscope-reorder``), and the collection is ordered longest groups
first: the Ray and engine groups start at once on both workers and the many short unit modules fill in at the
end, which keeps the two workers' finishing times close.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
from xdist.scheduler import LoadScopeScheduling

REPO = Path(__file__).resolve().parents[2]
RAY_GROUP = "ray"
RAY_DIRS = ("tests/e2e/", "tests/integration/ray/")
# Modules outside RAY_DIRS whose tests start Ray.
RAY_FILES = frozenset({
    "tests/integration/platform/test_local_redis_data.py",
    "tests/integration/tenancy/test_redis_crash_durability.py",
})
# Shared engine fixtures (session or package scope): name -> (the directory that sees it, the group of every
# module there that names it).
SHARED_FIXTURE_GROUPS = {
    "tenancy_engine": ("tests/integration/tenancy/", "tenancy-engine"),
    "gateways": ("tests/integration/tenancy/", "tenancy-engine"),
    "fp8_engine": ("tests/integration/platform/", "fp8-engine"),
}
# Where groups go in the collection: lower first. Ray and the engine groups are the longest.
_RANK_RAY, _RANK_SHARED, _RANK_INTEGRATION, _RANK_OTHER = 0, 1, 2, 3


def group_of(path: str, source: str) -> tuple[int, str]:
    """(rank, group) of the test module at ``path`` (relative to the repository, POSIX separators) whose
    text is ``source``."""
    if path in RAY_FILES or path.startswith(RAY_DIRS):
        return _RANK_RAY, RAY_GROUP
    for name, (directory, group) in SHARED_FIXTURE_GROUPS.items():
        # A fixture is named as a parameter ("gateways: ..."), never as part of a longer name or a module.
        if path.startswith(directory) and re.search(rf"\b{name}\s*[:,)]", source):
            return _RANK_SHARED, group
    rank = _RANK_INTEGRATION if path.startswith("tests/integration/") else _RANK_OTHER
    return rank, path


@cache
def group_of_module(path: str) -> tuple[int, str]:
    try:
        source = (REPO / path).read_text()
    except OSError:
        source = ""
    return group_of(path, source)


class GroupScheduling(LoadScopeScheduling):
    """xdist's scope scheduler with our groups as scopes."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of_module(nodeid.split("::", 1)[0])[1]


def order_by_group(items: list[pytest.Item]) -> None:
    """Orders ``items`` by their group's rank; the sort is stable, so tests keep their order within a module
    and a group, and module and package fixtures still set up once."""
    items.sort(key=lambda item: group_of_module(item.nodeid.split("::", 1)[0])[0])


__all__ = ["RAY_GROUP", "GroupScheduling", "group_of", "group_of_module", "order_by_group"]
