"""``tessera doctor`` against the real vLLM install: what an engine runs with here, and its exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tessera.doctor import engine_findings

TESSERA = str(Path(sys.executable).parent / "tessera")


def test_without_fp8_doctor_reports_the_fallback_and_its_capacity(cpu_without_fp8_kv: None,
                                                                  small_model_dir: Path) -> None:
    summary, fallback = engine_findings(small_model_dir, {})
    assert "KV cache dtype auto (asked: fp8)" in summary.seen and "speculative method ngram" in summary.seen
    # The small model in bf16: 2 layers x 2 KV heads x 32 head size x 2 (K and V) x 2 bytes per token.
    assert "65,536 blocks x 32 = 2,097,152 tokens (1 GiB at 512 bytes per token)" in summary.seen
    assert "AVX-512 or AMX" in fallback.seen and fallback.problem is None


def test_a_strict_config_the_platform_refuses_is_a_problem(cpu_without_fp8_kv: None, small_model_dir: Path) -> None:
    (finding,) = engine_findings(small_model_dir, {"kvCacheDtypeStrict": True})
    assert finding.problem is not None and "kvCacheDtypeStrict" in finding.problem


def test_doctor_command_exits_zero_here_and_one_naming_a_missing_redis(tmp_path: Path,
                                                                       small_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TESSERA_REDIS_URL"}
    ok = subprocess.run([TESSERA, "doctor", "--model", str(small_model_dir), "--port", "0", "--json"],
                        capture_output=True, text=True, env=env, timeout=300)
    report = json.loads(ok.stdout)
    assert ok.returncode == 0 and report["ok"], ok.stdout + ok.stderr
    areas = {f["area"] for f in report["findings"]}
    assert {"CPU", "memory", "GPU", "vLLM", "Ray", "Redis", "ports", "engine"} <= areas
    bad = subprocess.run([TESSERA, "doctor", "--model", str(small_model_dir), "--port", "0"], capture_output=True,
                         text=True, env={**env, "TESSERA_REDIS_URL": "redis://127.0.0.1:1/0"}, timeout=300)
    assert bad.returncode == 1 and "✗ Redis" in bad.stdout and "not reachable" in bad.stdout
