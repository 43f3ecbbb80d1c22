"""The engine settings the chart renders are the ones given, they parse into EngineConfig, and the chart
accepts exactly the engine settings EngineConfig accepts (schema and template checks together)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import helm_python
import pytest
from tests.support.chart import CHART_DIR, CI_VALUES, load_values, render, serve_config, served_engine
from pydantic import ValidationError

from tessera.engine.config import EngineConfig
from tessera_operators.operator.builders import build_serve_application

VALUES_IDS = [p.name.removesuffix("-values.yaml") for p in CI_VALUES]


@pytest.mark.parametrize("values_file", CI_VALUES, ids=VALUES_IDS)
def test_serve_config_engine_settings_equal_the_values(values_file: Path) -> None:
    values = load_values(values_file)
    applications = {a["name"]: a for a in serve_config(render(values))["applications"]}
    assert list(applications) == [m["name"] for m in values["models"]]
    for model in values["models"]:
        rendered = applications[model["name"]]["args"]["engine"]
        # Unchanged, except pvc:// model paths, which become the paths where the chart mounts their claims.
        expected = served_engine(model["engine"])
        assert rendered == expected, "the chart must pass engine settings through unchanged"
        assert EngineConfig.model_validate(rendered, strict=True) == EngineConfig.model_validate(expected)
        # The operator's builder makes the same application from the same settings (Model objects).
        # An autoscaled model has no fixed count (the two are exclusive).
        replicas = None if "autoscaling" in model["engine"] else model.get("replicas", 1)
        assert applications[model["name"]] == build_serve_application(model["name"], expected, replicas)


def _first_engine(values: dict[str, Any]) -> EngineConfig:
    application = serve_config(render(values))["applications"][0]
    return EngineConfig.model_validate(application["args"]["engine"], strict=True)


def test_eagle_draft_model_and_fp8_settings_arrive() -> None:
    eagle = _first_engine(load_values(CHART_DIR / "ci" / "eagle-values.yaml"))
    assert eagle.speculative is not None and eagle.speculative.method == "eagle"
    assert eagle.speculative.draft_model == "/models/eagle-llama-3.1-8b-instruct"
    assert eagle.kv_cache_dtype == "fp8"
    off = _first_engine(load_values(CHART_DIR / "ci" / "fp8-off-values.yaml"))
    assert off.kv_cache_dtype == "auto" and off.speculative is None


def test_large_integers_survive_rendering() -> None:
    """Helm holds numbers as float64; the serve config must not turn 131072 into 1.31072e+05."""
    engine = {
        "model": "/m",
        "maxModelLen": 131072,
        "maxNumBatchedTokens": 1048576,
        "numGpuBlocksOverride": 100000,
    }
    rendered = serve_config(render({"models": [{"name": "m", "engine": engine}]}))["applications"][0]
    assert rendered["args"]["engine"] == engine


BASE: dict[str, Any] = {"model": "/models/m"}
# (engine settings, why) — valid and invalid, covering every EngineConfig validator and field kind.
CASES: list[tuple[dict[str, Any], str]] = [
    ({}, "defaults"),
    ({"kvCacheDtype": "auto"}, "fp8 off"),
    ({"kvCacheDtype": "fp8_e5m2"}, "fp8 variant"),
    ({"kvCacheDtype": "int4"}, "unknown dtype"),
    ({"speculative": None}, "speculation off"),
    ({"speculative": {}}, "speculation defaults (ngram)"),
    ({"speculative": {"method": "eagle", "draftModel": "/models/d"}}, "eagle with draft"),
    ({"speculative": {"method": "eagle3"}}, "eagle3 without draft"),
    ({"speculative": {"method": "draft_model", "draftModel": ""}}, "empty draft path"),
    ({"speculative": {"method": "ngram", "draftModel": "/models/d"}}, "ngram with a draft"),
    ({"speculative": {"method": "mtp", "numSpeculativeTokens": 2}}, "mtp"),
    ({"speculative": {"numSpeculativeTokens": 0}}, "too few tokens"),
    ({"speculative": {"numSpeculativeTokens": 17}}, "too many tokens"),
    ({"speculative": {"promptLookupMin": 5, "promptLookupMax": 3}}, "n-gram bounds inverted"),
    ({"speculative": {"promptLookupMin": 5}}, "min above the default max"),
    ({"speculative": {"promptLookupMax": 1}}, "max below the default min"),
    ({"speculative": {"promptLookupMin": 3, "promptLookupMax": 3}}, "equal bounds"),
    ({"tensorParallelSize": 0}, "no GPUs"),
    ({"gpuMemoryUtilization": 0}, "zero memory"),
    ({"gpuMemoryUtilization": 1.0}, "all memory"),
    ({"maxNumSeqs": 0}, "no sequences"),
    ({"maxModelLen": 8}, "context too short"),
    ({"numGpuBlocksOverride": 64, "blockSize": 32, "maxModelLen": 2048}, "KV fits exactly"),
    ({"numGpuBlocksOverride": 63, "blockSize": 32, "maxModelLen": 2048}, "KV one block short"),
    ({"numGpuBlocksOverride": 10}, "KV too small for the default context"),
    ({"numGpuBlocksOverride": None}, "explicit null override"),
    ({"httpPort": 70000}, "port out of range"),
    ({"kvEvents": {"enabled": False}}, "events off"),
    ({"kvEvents": {"endpoint": "tcp://0.0.0.0:*", "topc": "kv"}}, "typo in nested object"),
    ({"schedulingPolicy": "lifo"}, "unknown policy"),
    ({"dtype": "bfloat16", "enforceEager": False, "seed": 7}, "plain fields"),
    ({"maxNumSeqs": "64"}, "number as string"),
    ({"kvScaleMode": "dynamic"}, "dynamic scales with fp8"),
    ({"kvScaleMode": "dynamic", "kvCacheDtype": "fp8_e5m2"}, "dynamic scales need e4m3"),
    ({"kvScaleMode": "dynamic", "kvCacheDtype": "auto"}, "dynamic scales need fp8"),
    ({"calculateKvScales": True}, "older scale flag"),
    ({"autoscaling": {"maxReplicas": 3}}, "autoscaling defaults"),
    ({"autoscaling": None}, "autoscaling off"),
    ({"autoscaling": {}}, "autoscaling without maxReplicas"),
    ({"autoscaling": {"minReplicas": 2, "maxReplicas": 2}}, "autoscaling min = max"),
    ({"autoscaling": {"minReplicas": 3, "maxReplicas": 2}}, "autoscaling min above max"),
    ({"autoscaling": {"minReplicas": 2, "maxReplicas": 1}}, "autoscaling default-less min above max"),
    ({"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}, "autoscaling to zero"),
    ({"autoscaling": {"maxReplicas": 4, "initialReplicas": 5}}, "autoscaling initial above max"),
    ({"autoscaling": {"minReplicas": 2, "maxReplicas": 4, "initialReplicas": 1}}, "autoscaling initial below min"),
    ({"autoscaling": {"maxReplicas": 4, "initialReplicas": 4}}, "autoscaling initial at max"),
    ({"autoscaling": {"maxReplicas": 2, "metricsIntervalS": 30}}, "metrics interval = default window"),
    ({"autoscaling": {"maxReplicas": 2, "lookBackPeriodS": 5}}, "window below the default interval"),
    ({"autoscaling": {"maxReplicas": 2, "lookBackPeriodS": 2, "metricsIntervalS": 0.5}}, "short window"),
    ({"autoscaling": {"maxReplicas": 2, "metric": "kvCacheUsage", "targetKvCacheUsage": 0.8}}, "KV usage signal"),
    ({"autoscaling": {"maxReplicas": 2, "metric": "gpuUtil"}}, "unknown signal"),
    ({"autoscaling": {"maxReplicas": 2, "targetKvCacheUsage": 1.2}}, "KV target above 1"),
    ({"autoscaling": {"maxReplicas": 2, "maxReplica": 3}}, "typo in autoscaling"),
    ({"drainTimeoutS": 0}, "no drain"),
    ({"drainTimeoutS": -1}, "negative drain"),
]


def _engine_config_accepts(engine: dict[str, Any]) -> bool:
    try:
        EngineConfig.model_validate(engine, strict=True)
    except ValidationError:
        return False
    return True


def _chart_accepts(engine: dict[str, Any]) -> bool:
    try:
        # Workers with GPUs for the largest autoscaling.maxReplicas above: the chart's own GPU check is not
        # what this compares (test_helm_autoscaling.py tests it).
        render({"models": [{"name": "m", "engine": engine}],
                "rayService": {"engineWorkers": {"replicas": 4, "maxReplicas": 4}}})
    except (helm_python.HelmValuesError, helm_python.HelmRenderError):
        return False
    return True


@pytest.mark.parametrize(("extra", "why"), CASES, ids=[why for _, why in CASES])
def test_chart_accepts_exactly_what_engine_config_accepts(extra: dict[str, Any], why: str) -> None:
    engine = {**BASE, **extra}
    expected = _engine_config_accepts(engine)
    assert _chart_accepts(engine) is expected, (
        f"{why}: EngineConfig {'accepts' if expected else 'rejects'} {engine} but the chart does not agree; "
        "update scripts/gen_chart_schema.py (_add_cross_field_rules) or templates/_validate.tpl"
    )


def test_build_app_accepts_every_rendered_application() -> None:
    """The rendered serveConfigV2 is what the engine's Serve builder takes: build_app binds each
    application (no Ray cluster needed) without rejecting an argument. Slower than the rest: it imports
    Ray Serve and vLLM."""
    from ray.serve import Application

    from tessera.engine.deployment import build_app

    for values_file in CI_VALUES:
        for application in serve_config(render(load_values(values_file)))["applications"]:
            assert isinstance(build_app(application["args"]), Application), (
                values_file.name,
                application["name"],
            )


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "llama-3-8b", "--gpu", "h100-sxm", "--context-len", "8192"],
        ["--model", "llama-3-70b", "--gpu", "h200", "--context-len", "32768"],
    ],
    ids=["llama-3-8b", "llama-3-70b"],
)
def test_a_values_file_written_by_the_planner_installs(tmp_path: Path, args: list[str]) -> None:
    """`tessera plan serve --values-out` writes a file the chart accepts, and its settings arrive intact."""
    from typer.testing import CliRunner

    from tessera.cli.plan import plan_app

    values_file = tmp_path / "planned-values.yaml"
    result = CliRunner().invoke(plan_app, ["serve", *args, "--values-out", str(values_file)])
    assert result.exit_code == 0, result.output
    values = load_values(values_file)
    # The planner sizes tensor parallelism; give the worker pods that many GPUs, as an operator would.
    gpus = max(m["engine"]["tensorParallelSize"] for m in values["models"])
    values["rayService"] = {"engineWorkers": {"gpusPerPod": gpus}}
    applications = serve_config(render(values))["applications"]
    assert [a["args"]["engine"] for a in applications] == [m["engine"] for m in values["models"]]
    for application in applications:
        EngineConfig.model_validate(application["args"]["engine"], strict=True)
