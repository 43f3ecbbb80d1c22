"""Fixtures shared by every test directory: a real Redis-protocol server and the small generated model."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tessera.data_plane_auth import ensure_key_file
from tessera.engine.small_model import is_small_model_dir, make_small_model
from tessera.redis_conn import EmbeddedRedis
from tests.support.parallel import GroupScheduling, order_by_group

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# One unbound OpenMP thread per test engine: vLLM's CPU worker otherwise binds a thread to every core, so two
# engines (two xdist workers, or a test's two replicas) pin their threads onto the same cores and spin on
# each other; every engine test then ran about twice as long as alone. The tiny model gains nothing from more.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The data-plane key, set before anything starts: every replica, gateway and controller a test starts (in
# process, as a subprocess or in a Ray worker) inherits it; tests/support/data_plane.py signs with it.
os.environ.setdefault("TESSERA_DATA_PLANE_KEY_FILE",
                      str(ensure_key_file(REPO / ".tessera" / "test-data-plane.key")))
# The tests' traces go to a per-session directory, never the developer's .tessera/.
os.environ.setdefault("TESSERA_TRACE_EXPORTER", "jsonl")


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def own_redis() -> Iterator[EmbeddedRedis]:
    """A Redis of the test module's own: for tests that read what the whole server holds or counts (command
    statistics, global keys), which the session's shared one mixes with other tests'."""
    server = EmbeddedRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def small_model_dir() -> Path:
    """The default small model, generated once per checkout (deterministic from its seed)."""
    path = REPO / ".tessera" / "models" / "tessera-small"
    path.parent.mkdir(parents=True, exist_ok=True)
    # `make test`'s two workers ask at once on a fresh clone: one generates, the other waits and reuses it.
    with (path.parent / ".tessera-small.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_small_model_dir(path):
            make_small_model(path)
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Only in an xdist worker (`make test` runs two): longest groups first (tests/support/parallel.py).
    if hasattr(config, "workerinput"):
        order_by_group(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> GroupScheduling:
    # Each group (Ray, a shared engine, else a module) runs whole on one worker (tests/support/parallel.py).
    return GroupScheduling(config, log)
