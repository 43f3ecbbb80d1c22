"""shm_wait: the busy-wait cap reaches vLLM's shared-memory queue readers, once, and only when configured."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast
from vllm.utils.network_utils import get_open_zmq_ipc_path

from tessera.engine import shm_wait
from tessera.engine.config import EngineConfig
from tessera.engine.placement import installed_vllm_build
from tessera.engine.vllm_engine import shm_busy_loop_s


@pytest.fixture
def spin_condition(monkeypatch: pytest.MonkeyPatch) -> Iterator[shm_broadcast.SpinCondition]:
    """A real reader-side SpinCondition (vLLM's default busy loop: 1 s) with vLLM's own ``wait``; the class is
    restored afterwards. (An engine started earlier in this process may have installed the cap already.)"""
    vllm_wait = shm_broadcast.SpinCondition.wait
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", getattr(vllm_wait, "__tessera_original__", vllm_wait))
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    reader = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    assert reader.busy_loop_s == 1
    yield reader
    for sock in (reader.local_notify_socket, reader.read_cancel_socket, reader.write_cancel_socket,
                 writer.local_notify_socket):
        sock.close(linger=0)
    context.term()


def test_install_caps_the_busy_loop_of_readers_made_before_it(spin_condition: shm_broadcast.SpinCondition,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shm_wait.ENV, "0.0")
    original = shm_broadcast.SpinCondition.wait
    shm_wait.install()
    shm_wait.install()  # idempotent: one wrapper around vLLM's own wait, not two
    assert shm_broadcast.SpinCondition.wait.__tessera_original__ is original  # type: ignore[attr-defined]
    spin_condition.wait(timeout_ms=1)  # past the cap: sleeps on the socket, returns after 1 ms
    assert spin_condition.busy_loop_s == 0.0


def test_without_the_setting_vllms_own_busy_loop_stays(spin_condition: shm_broadcast.SpinCondition,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shm_wait.ENV, raising=False)
    original = shm_broadcast.SpinCondition.wait
    shm_wait.install()
    assert shm_broadcast.SpinCondition.wait is original
    assert spin_condition.busy_loop_s == 1


@pytest.mark.parametrize(("idle_s", "timeout_ms", "expected"), [
    (0.0, 5000, 1),        # just read: recheck within a millisecond (a lost notification costs that much)
    (0.002, 5000, 1),
    (0.3, 5000, 1),        # within the warm second: a request 0.3 s after the last finds a lost wake-up in 1 ms
    (1.0, 5000, 250),      # then a quarter of the idle time
    (60.0, 5000, 5000),    # never longer than vLLM's own interval
    (60.0, None, 15000),
])
def test_a_sleeping_reader_rechecks_each_millisecond_for_a_second_then_after_a_quarter_of_its_idle_time(
        idle_s: float, timeout_ms: int | None, expected: int) -> None:
    assert shm_wait.recheck_ms(idle_s, timeout_ms) == expected


def test_the_busy_wait_defaults_to_zero_on_the_cpu_build_and_to_vllms_second_with_gpus() -> None:
    assert installed_vllm_build() == "cpu"  # this project's test machines run vLLM's CPU build
    assert shm_busy_loop_s(EngineConfig(model="/m")) == 0.0
    assert shm_busy_loop_s(EngineConfig(model="/m", accelerator="gpu")) == 1.0
    assert shm_busy_loop_s(EngineConfig(model="/m", shm_busy_loop_s=0.25)) == 0.25
