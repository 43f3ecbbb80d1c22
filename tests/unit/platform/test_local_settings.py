"""`tessera up`'s machine settings: the quiet Ray environment (a value already set wins) and the CPU split."""

from __future__ import annotations

import os

import pytest

from tessera.cpu_info import cpu_flags
from tessera.engine.config import EngineConfig
from tessera.engine.vllm_engine import shm_busy_loop_s
from tessera.local.platform import (
    PINNED_SHM_BUSY_LOOP_S,
    SHARED_CORE_OMP_WAIT,
    engine_placement_defaults,
    engine_thread_env,
    split_cpus,
)
from tessera.local.ray_settings import QUIET_RAY_ENV, quiet_ray_env, ray_init_kwargs


def test_a_ray_setting_already_in_the_environment_wins() -> None:
    env = quiet_ray_env({"RAY_event_stats": "1", "PATH": "/bin"})
    assert "RAY_event_stats" not in env
    assert env == {k: v for k, v in QUIET_RAY_ENV.items() if k != "RAY_event_stats"}
    assert all(name.startswith("RAY_") for name in QUIET_RAY_ENV)


def test_ray_starts_without_dashboard_and_without_copying_worker_logs() -> None:
    kwargs = ray_init_kwargs(2, {"TESSERA_X": "1"})
    assert kwargs["include_dashboard"] is False and kwargs["log_to_driver"] is False
    assert kwargs["runtime_env"] == {"env_vars": {"TESSERA_X": "1"}} and kwargs["num_cpus"] == 2


def test_the_split_gives_the_platform_the_last_core_and_the_engines_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert split_cpus() == ({0, 1, 2}, {3})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert split_cpus() == ({0, 1}, {2})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert split_cpus() == (None, None)


def test_on_two_cores_the_engine_also_computes_on_the_platforms_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # One core of its own would halve the engine's prefill compute (docs/performance.md section 7).
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 7})
    assert split_cpus() == ({4, 7}, {7})


def test_engine_threads_one_per_engine_core_with_a_short_wait_only_on_a_shared_core() -> None:
    shared = engine_thread_env({0, 1}, {1}, {0, 1}, 1, {})
    assert shared == {"OMP_NUM_THREADS": "2", **SHARED_CORE_OMP_WAIT}
    assert engine_thread_env({0, 1, 2}, {3}, {0, 1, 2, 3}, 1, {}) == {"OMP_NUM_THREADS": "3"}
    assert engine_thread_env({0, 1, 2}, {3}, {0, 1, 2, 3}, 2, {}) == {"OMP_NUM_THREADS": "1"}
    assert engine_thread_env(None, None, {0, 1, 2, 3}, 1, {}) == {"OMP_NUM_THREADS": "4"}  # no split
    # What the environment already says wins.
    assert engine_thread_env({0, 1}, {1}, {0, 1}, 1, {"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}) == {}
    # Either wait setting replaces the default: an ACTIVE wait is not cut to a few milliseconds, nor a spin changed.
    assert engine_thread_env({0, 1}, {1}, {0, 1}, 1, {"OMP_WAIT_POLICY": "ACTIVE"}) == {"OMP_NUM_THREADS": "2"}
    assert engine_thread_env({0, 1}, {1}, {0, 1}, 1, {"GOMP_SPINCOUNT": "0"}) == {"OMP_NUM_THREADS": "2"}


def test_the_shared_core_wait_spins_libgomps_default_few_milliseconds_then_sleeps() -> None:
    # Passive alone sleeps after every parallel region (a hypervisor wake per region on a VM); a ~1 ms spin lost
    # to ~3 ms under steal; ACTIVE's forever would hold the platform's core (docs/performance.md section 7).
    assert "OMP_WAIT_POLICY" not in SHARED_CORE_OMP_WAIT
    assert int(SHARED_CORE_OMP_WAIT["GOMP_SPINCOUNT"]) == 300_000


AVX512 = frozenset({"avx2", "avx512f", "avx512bw"})


def test_on_a_shared_core_a_cpu_with_512_bit_vectors_runs_a_worker_process_model_on_one_thread() -> None:
    # Its prefill on one thread is short, and a second thread's wake-ups slow every decode step
    # (docs/performance.md section 7); an AVX2-only CPU keeps a thread per core.
    amx = frozenset({"avx2", "amx_tile"})
    avx2 = frozenset({"avx2", "fma"})
    assert engine_thread_env({0, 1}, {1}, {0, 1}, 1, {}, AVX512, model_in_worker_process=True) == {
        "OMP_NUM_THREADS": "1", **SHARED_CORE_OMP_WAIT}
    assert engine_thread_env({0, 1}, {1}, {0, 1}, 1, {}, amx, model_in_worker_process=True)["OMP_NUM_THREADS"] == "1"
    assert engine_thread_env({0, 1}, {1}, {0, 1}, 1, {}, avx2, model_in_worker_process=True)["OMP_NUM_THREADS"] == "2"
    # Cores of its own (3 CPUs and more), or no split: a thread per core whatever the vectors.
    assert engine_thread_env({0, 1, 2}, {3}, {0, 1, 2, 3}, 1, {}, AVX512, model_in_worker_process=True) == {
        "OMP_NUM_THREADS": "3"}
    assert engine_thread_env(None, None, {0, 1}, 1, {}, AVX512, model_in_worker_process=True) == {
        "OMP_NUM_THREADS": "2"}
    assert engine_thread_env({0, 1}, {1}, {0, 1}, 1, {"OMP_NUM_THREADS": "2"}, AVX512,
                             model_in_worker_process=True) == SHARED_CORE_OMP_WAIT


def test_a_model_in_the_engine_core_keeps_a_thread_per_core_with_512_bit_vectors_too() -> None:
    # cpuModelInEngineCore (the default): no queue hand-over per step, and the second thread pays again.
    assert engine_thread_env({0, 1}, {1}, {0, 1}, 1, {}, AVX512) == {
        "OMP_NUM_THREADS": "2", **SHARED_CORE_OMP_WAIT}


def test_cpu_flags_come_from_the_first_processors_flags_line() -> None:
    text = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t: fpu\n"
    assert cpu_flags(text) == frozenset({"fpu", "avx2", "avx512f"})
    assert cpu_flags("processor : 0\nFeatures : fp asimd\n") == frozenset()  # arm64 names them "Features"


def test_an_engine_on_cores_of_its_own_busy_waits_briefly_and_a_setting_given_wins() -> None:
    def resolved(pinned: bool, overrides: dict[str, object]) -> float:
        config = EngineConfig.model_validate({"model": "/m", **engine_placement_defaults(pinned, overrides),
                                              **overrides})
        return shm_busy_loop_s(config)

    assert resolved(True, {}) == PINNED_SHM_BUSY_LOOP_S
    assert 0 < PINNED_SHM_BUSY_LOOP_S < 1.0  # vLLM's own second would spin out every idle gap
    assert resolved(False, {}) == 0.0  # unpinned on CPU: the spin would take the gateway's core
    assert resolved(True, {"shmBusyLoopS": 0.5}) == 0.5
    assert resolved(True, {"shm_busy_loop_s": 0}) == 0.0
