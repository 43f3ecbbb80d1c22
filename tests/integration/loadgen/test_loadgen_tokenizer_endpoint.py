"""Token-exact prompt lengths end to end: the tokenizer fetched over HTTP from a server that speaks the
gateway's ``GET /v1/models/{model}/tokenizer`` contract and counts ``usage.prompt_tokens`` with the gateway's
code; and the approximate fallback against a server without that endpoint (the mock server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tessera_loadgen.client import Target
from tessera_loadgen.runner import run_in_loop
from tessera_loadgen.tokenizer_source import resolve_tokenizers
from tessera_loadgen.workload import Workload
from tests.support.gateway_stub import gateway_stub

MODEL = "tessera-small"
KEYS = {"key-chat", "key-batch"}

WORKLOAD: dict[str, Any] = {
    "name": "token-lengths",
    "seed": 5,
    "num_requests": 48,
    "model": MODEL,
    "prefix_groups": {"sys": {"num_prefixes": 2, "prefix_tokens": 120}},
    "tenants": [
        {
            "name": "chat",
            "api_key": "key-chat",
            "arrival": {"process": "poisson", "rate_rps": 40},
            "classes": [
                {"name": "plain", "prompt": {"tokens": 200}, "output_tokens": 4},
                {"name": "prefixed", "prompt": {"tokens": 50, "prefix_group": "sys"}, "output_tokens": 4},
                {"name": "session", "prompt": {"tokens": 60}, "output_tokens": 8, "session": {"turns": 3}},
            ],
        },
        {
            "name": "batch",
            "api_key": "key-batch",
            "arrival": {"process": "poisson", "rate_rps": 20},
            "classes": [
                {
                    "name": "long",
                    "endpoint": "completions",
                    "stream": False,
                    "prompt": {"tokens": {"kind": "uniform", "low": 600, "high": 1200}},
                    "output_tokens": 4,
                },
            ],
        },
    ],
}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tessera_loadgen.cli", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=dict(os.environ),
    )


def write_workload(tmp_path: Path, workload: dict[str, Any]) -> Path:
    path = tmp_path / "workload.yaml"
    path.write_text(yaml.safe_dump(workload))
    return path


def test_run_fetches_the_tokenizer_and_hits_the_asked_lengths(tmp_path: Path, small_model_dir: Path) -> None:
    with gateway_stub(small_model_dir, KEYS) as (url, stub):
        run_dir = tmp_path / "run"
        done = cli(
            "run",
            str(write_workload(tmp_path, WORKLOAD)),
            "--target",
            url,
            "--out",
            str(run_dir),
            "--no-progress",
            "--no-plots",
        )
    assert done.returncode == 0, done.stderr
    assert f"prompt lengths for {MODEL} in its tokens (tokenizer: {url}/v1/models/{MODEL}/tokenizer)" in done.stderr
    assert "approximate" not in done.stderr
    assert stub.tokenizer_requests == ["Bearer key-chat"]  # once per model, with a key of a tenant using it

    result = json.loads((run_dir / "result.json").read_text())
    assert result["run"]["prompt_lengths"] == "tokens"
    assert result["run"]["tokenizers"] == {MODEL: f"{url}/v1/models/{MODEL}/tokenizer"}
    lines = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert all(line["ok"] for line in lines)
    # Every request asked a length (turns after the first: history as counted + 60) and got it within 2 %.
    for line in lines:
        assert line["n_in_asked"] is not None
        assert abs(line["n_in"] - line["n_in_asked"]) <= 0.02 * line["n_in_asked"], line
    assert {line["turn"] for line in lines if line["session_id"]} >= {0, 1}

    classes = result["summary"]["tenants"]["chat"]["classes"]
    assert classes["plain"]["prompt_tokens"]["asked"]["p50"] == 200
    assert classes["prefixed"]["prompt_tokens"]["asked"]["p50"] == 170  # prefix 120 + 50
    for tenant in result["summary"]["tenants"].values():
        for summary in tenant["classes"].values():
            assert summary["prompt_tokens"]["share_within_tolerance"] == 1.0
    assert "prompt tokens" in done.stdout and "asked in the model's tokens" in done.stdout


def test_resolution_reports_why_a_tokenizer_is_missing(small_model_dir: Path) -> None:
    workload = Workload.model_validate({**WORKLOAD, "tenants": [{**WORKLOAD["tenants"][1], "api_key": "wrong-key"}]})
    with gateway_stub(small_model_dir, KEYS) as (url, _):
        target = Target.parse(url)
        denied = run_in_loop(resolve_tokenizers("auto", target, workload, {"batch": MODEL}))
        unknown = run_in_loop(
            resolve_tokenizers("auto", target, workload.with_keys({"batch": "key-batch"}), {"batch": "other-model"})
        )
        found = run_in_loop(
            resolve_tokenizers("auto", target, workload.with_keys({"batch": "key-batch"}), {"batch": MODEL})
        )
    assert denied.specs == {} and "answered 401 (Invalid API key.)" in denied.warnings[0]
    assert unknown.specs == {} and "answered 404 (The model 'other-model' does not exist.)" in unknown.warnings[0]
    assert found.warnings == [] and found.specs[MODEL].max_model_len == 2048


def test_validate_asks_the_gateway_for_the_context(tmp_path: Path, small_model_dir: Path) -> None:
    with gateway_stub(small_model_dir, KEYS) as (url, _):
        done = cli("validate", str(write_workload(tmp_path, WORKLOAD)), "--target", url)
    assert done.returncode == 0, done.stderr
    assert "context: max_model_len 2048" in done.stdout and "every class fits" in done.stdout

    overflowing = {
        **WORKLOAD,
        "tenants": [
            {**WORKLOAD["tenants"][1], "classes": [{**WORKLOAD["tenants"][1]["classes"][0], "output_tokens": 1000}]}
        ],
    }
    with gateway_stub(small_model_dir, KEYS) as (url, _):
        done = cli("validate", str(write_workload(tmp_path, overflowing)), "--target", url)
    assert done.returncode == 0, done.stderr
    assert (
        "warning: tenant 'batch' class 'long': prompt up to 1200 + max_tokens up to 1000 = 2200 tokens > "
        f"max_model_len 2048 of {MODEL}" in done.stderr
    )


def test_without_the_endpoint_lengths_are_approximate_and_flagged(
    tmp_path: Path, mock_server: Callable[..., str]
) -> None:
    url = mock_server()
    workload = {**WORKLOAD, "model": "mock-model", "num_requests": 12}
    run_dir = tmp_path / "run"
    done = cli(
        "run",
        str(write_workload(tmp_path, workload)),
        "--target",
        url,
        "--out",
        str(run_dir),
        "--no-progress",
        "--no-plots",
    )
    assert done.returncode == 0, done.stderr
    assert "warning: prompt lengths for mock-model are approximate (words, not the model's tokens)" in done.stderr
    assert "/v1/models/mock-model/tokenizer answered 404" in done.stderr
    result = json.loads((run_dir / "result.json").read_text())
    assert result["run"]["prompt_lengths"] == "approximate"
    assert result["run"]["tokenizers"] == {"mock-model": None}
    assert "asked in words (approximate: no tokenizer)" in done.stdout
    report = cli("report", str(run_dir))
    assert "asked in words (approximate: no tokenizer)" in report.stdout
