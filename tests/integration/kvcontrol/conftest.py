"""Fixtures of the controller's integration tests: a real stack per test module (see stack.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tessera.redis_conn import EmbeddedRedis
from tests.support.kvstack import KVStack, StackOptions

StackFactory = Callable[..., KVStack]


@pytest.fixture(scope="module")
def make_stack(small_model_dir: Path, redis_server: EmbeddedRedis,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[StackFactory]:
    """Starts stacks for one test module and stops them at its end."""
    started: list[KVStack] = []

    def make(name: str, num_engines: int = 1, **engine: Any) -> KVStack:
        options = StackOptions(model_dir=small_model_dir, redis_url=redis_server.url,
                               run_dir=tmp_path_factory.mktemp(name), num_engines=num_engines,
                               served_model_name=f"kvc-{name}")
        options.engine.update(engine)
        # The session's Redis is shared: this stack's controller controls only its own engines.
        options.env["TESSERA_KVCONTROL_MODEL"] = options.served_model_name
        stack = KVStack(options)
        started.append(stack)
        return stack.start()

    yield make
    for stack in started:
        stack.stop()

