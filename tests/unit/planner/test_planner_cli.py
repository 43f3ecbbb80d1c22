"""``tessera plan train | diagnose | serve`` through typer's CliRunner: tables, --json, values, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

from tessera.cli.plan import plan_app
from tessera.engine.config import EngineConfig

runner = CliRunner()
DOCS = Path(__file__).resolve().parents[3] / "docs" / "planner.md"
SEED = [
    "diagnose",
    "--model",
    "llama-3-70b",
    "--gpu",
    "h100-sxm",
    "--seq-len",
    "32768",
    "--mfu",
    "35",
    "--hfu",
    "62",
]


def run_json(*args: str) -> dict[str, Any]:
    result = runner.invoke(plan_app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def documented_keys() -> set[str]:
    return set(re.findall(r"`([a-z_0-9A-Z]+)`", DOCS.read_text(encoding="utf-8")))


def test_train_table() -> None:
    parallel = ["--tp", "8", "--pp", "4", "--dp", "8", "--num-microbatches", "16"]
    result = runner.invoke(
        plan_app, ["train", "--model", "llama-3-70b", "--seq-len", "8192", *parallel, "--step-time", "14"]
    )
    assert result.exit_code == 0, result.output
    for text in (
        "FLOPs per token",
        "Memory per GPU",
        "Activations by recomputation mode",
        "Communication",
        "MFU",
    ):
        assert text in result.output


def test_train_json() -> None:
    report = run_json(
        "train", "--model", "megatron-22b", "--gpu", "a100-80gb", "--seq-len", "2048", "--tp", "8"
    )
    assert report["parameters"]["total"] > 22e9
    assert set(report["flops_per_token"]) == {"6N", "causal", "full"}
    assert report["measured"] is None
    assert report["communication"][0]["dimension"] == "tp+sp"
    assert set(report) <= documented_keys()
    assert set(report["memory_per_gpu_gib"]) <= documented_keys()


def test_train_measured_mfu_matches_table_5() -> None:
    report = run_json(
        "train", "--model", "megatron-22b", "--gpu", "a100-80gb", "--seq-len", "2048", "--tp", "8",
        "--micro-batch", "4", "--recompute", "selective", "--no-flash", "--attention", "full",
        "--step-time", "1.10",
    )  # fmt: skip
    assert abs(report["measured"]["mfu_percent"] - 41.5) <= 0.2
    assert abs(report["measured"]["hfu_percent"] - 43.7) <= 0.2


def test_train_rejects_bad_options() -> None:
    result = runner.invoke(plan_app, ["train", "--model", "llama-3-8b", "--recompute", "some"])
    assert result.exit_code == 2 and "recompute" in result.output
    result = runner.invoke(plan_app, ["train", "--model", "gpt-5"])
    assert result.exit_code == 2 and "llama-3-8b" in result.output


def test_diagnose_seed_table() -> None:
    result = runner.invoke(plan_app, SEED)
    assert result.exit_code == 0, result.output
    flat = " ".join(result.output.split())
    assert "verdict: mixed-conventions" in flat
    assert "No consistent accounting allows this pair" in flat
    assert "MFU counts 6N (attention ignored)" in flat


def test_diagnose_seed_json() -> None:
    report = run_json(*SEED)
    assert report["verdict"] == "mixed-conventions"
    assert report["best"]["mfu_convention"] == "6N" and report["best"]["hfu_convention"] == "causal"
    assert set(report) <= documented_keys()
    assert set(report["best"]) <= documented_keys()


def test_serve_json_and_values_file(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    report = run_json(
        "serve", "--model", "llama-3-8b", "--gpu", "h100-sxm", "--context-len", "8192",
        "--model-path", "/models/llama-3-8b", "--values-out", str(values),
    )  # fmt: skip
    assert report["values_file"] == str(values)
    assert report["kv_bytes_per_token"] == {"bf16": 131072, "fp8": 65536, "int8": 65536}
    assert report["proposal"]["tensor_parallel_size"] == 1
    assert set(report) <= documented_keys()
    assert set(report["proposal"]) <= documented_keys()
    engine = yaml.safe_load(values.read_text())["models"][0]["engine"]
    config = EngineConfig.model_validate(engine)
    assert config.model == "/models/llama-3-8b" and config.served_model_name == "llama-3-8b"
    assert config.kv_cache_dtype == "fp8" and config.max_num_seqs == report["proposal"]["max_num_seqs"]


def test_serve_table() -> None:
    result = runner.invoke(
        plan_app, ["serve", "--model", "llama-3-70b", "--gpu", "h200", "--context-len", "32768"]
    )
    assert result.exit_code == 0, result.output
    for text in (
        "KV cache per GPU",
        "Roofline lower bounds",
        "proposed engine settings",
        "tensor_parallel_size=",
    ):
        assert text in result.output


def test_serve_that_does_not_fit_writes_no_values(tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    result = runner.invoke(plan_app, ["serve", "--model", "llama-3-405b", "--values-out", str(values)])
    assert result.exit_code == 2 and "no engine settings fit" in result.output
    assert not values.exists()
    table = runner.invoke(plan_app, ["serve", "--model", "llama-3-405b"])
    assert table.exit_code == 0 and "no tensor-parallel size fits" in table.output


def test_plan_is_registered_on_the_tessera_command() -> None:
    from tessera.cli import app

    result = runner.invoke(app, ["plan", "--help"])
    assert result.exit_code == 0
    for command in ("train", "diagnose", "serve"):
        assert command in result.output
