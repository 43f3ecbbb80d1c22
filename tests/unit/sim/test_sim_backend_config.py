"""``EngineConfig.backend``: a Ray Serve replica runs vLLM or a simulated engine, chosen by a typed field, and a
simulated replica's engine is built from the same config (engine/sim/serve_replica.py: sim_engine_config)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from tessera.engine.config import EngineConfig
from tessera.engine.sim.serve_replica import sim_engine_config
from tessera.engine.sim.step_time import MeasuredStepTime, RooflineStepTime

MEASURED = {"stepTime": "measured", "stepS": 0.01, "perSeqS": 0.001, "perPrefillTokenS": 1e-5}


def test_the_default_backend_is_vllm_and_an_unknown_one_is_refused_naming_the_valid_ones() -> None:
    assert EngineConfig(model="m").backend == "vllm"
    with pytest.raises(ValidationError) as caught:
        EngineConfig.model_validate({"model": "m", "backend": "tgi"})
    assert "'vllm' or 'sim'" in str(caught.value)


def test_sim_settings_only_with_the_sim_backend() -> None:
    with pytest.raises(ValidationError, match="sim settings apply to backend 'sim' only"):
        EngineConfig.model_validate({"model": "m", "sim": {"timeScale": 2}})
    assert EngineConfig.model_validate({"model": "m", "backend": "sim"}).sim_settings.step_time == "roofline"


def test_measured_step_time_needs_its_costs_and_a_block_count() -> None:
    with pytest.raises(ValidationError, match="needs perPrefillTokenS, perSeqS"):
        EngineConfig.model_validate({"model": "m", "backend": "sim", "sim": {"stepTime": "measured", "stepS": 0.01}})
    with pytest.raises(ValidationError, match="only apply to stepTime 'measured'"):
        EngineConfig.model_validate({"model": "m", "backend": "sim", "sim": {"stepS": 0.01}})
    with pytest.raises(ValidationError, match="needs numGpuBlocksOverride"):
        EngineConfig.model_validate({"model": "m", "backend": "sim", "sim": MEASURED})
    with pytest.raises(ValidationError, match="extra"):
        EngineConfig.model_validate({"model": "m", "backend": "sim", "sim": {"timescale": 2}})


def test_the_simulated_engine_takes_the_replica_settings_from_the_engine_config() -> None:
    config = EngineConfig.model_validate({
        "model": "/models/small", "backend": "sim", "servedModelName": "sim-70b", "tensorParallelSize": 4,
        "kvCacheDtype": "auto", "blockSize": 16, "maxModelLen": 4096, "maxNumSeqs": 32,
        "maxNumBatchedTokens": 1024, "schedulingPolicy": "priority", "heartbeatIntervalS": 0.5,
        "sim": {"gpu": "h100-sxm", "modelPreset": "llama-3-70b", "timeScale": 3, "stepOverheadS": 0.004}})
    sim = sim_engine_config(config, "10.0.0.5", "10.0.0.5")
    assert isinstance(sim.step_time, RooflineStepTime)
    assert (sim.step_time.tensor_parallel_size, sim.step_time.kv_cache_dtype, sim.step_time.step_overhead_s) == (
        4, "bf16", 0.004)
    assert sim.step_time.compute_efficiency == RooflineStepTime().compute_efficiency  # the sim's own default
    assert (sim.served_model_name, sim.tokenizer, sim.block_size, sim.max_model_len, sim.max_num_seqs,
            sim.max_num_batched_tokens, sim.scheduling_policy, sim.time_scale, sim.heartbeat_interval_s) == (
        "sim-70b", "/models/small", 16, 4096, 32, 1024, "priority", 3, 0.5)
    assert (sim.http_host, sim.advertise_host, sim.feed_index) == ("10.0.0.5", "10.0.0.5", True)
    # No block count: the planner sizes the KV cache of 4 H100s holding Llama-3-70B in bf16.
    assert sim.num_gpu_blocks is None and sim.resolved_num_gpu_blocks() > 1000

    measured = sim_engine_config(EngineConfig.model_validate({
        "model": "m", "backend": "sim", "numGpuBlocksOverride": 128, "kvEvents": {"enabled": False},
        "sim": MEASURED}))
    assert measured.step_time == MeasuredStepTime(step_s=0.01, per_seq_s=0.001, per_prefill_token_s=1e-5)
    assert (measured.num_gpu_blocks, measured.feed_index) == (128, False)


def test_a_simulated_replica_never_imports_vllm() -> None:
    """The deployment and the simulated host load without vLLM (engine/host.py is imported only for 'vllm')."""
    code = ("import sys, tessera.engine.deployment, tessera.engine.sim.serve_replica; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.') or m == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


def test_every_backend_has_a_replica_host() -> None:
    from typing import get_args

    from tessera.engine.config import EngineBackend
    from tessera.engine.deployment import REPLICA_HOSTS

    assert set(REPLICA_HOSTS) == set(get_args(EngineBackend)) == {"vllm", "sim"}
