"""The gateway reads the tokenizer directory a model's replicas register (tessera.engine.tokenizer_source):
for a hub id, its snapshot in the engines' Hugging Face cache. The chart makes that path readable in the
gateway pods (templates/_tokenizers.tpl): the shared cache claim, or the gateway's own fetch of the same
repositories' tokenizer files into a cache at the same path."""

from __future__ import annotations

import ast

from tessera.engine.tokenizer_source import TOKENIZER_FILES
from tests.support.chart import CHART_DIR, JSON, find, load_values, render


def _gateway(docs: list[JSON]) -> JSON:
    spec: JSON = find(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]
    return spec


def _engine_hf_home(docs: list[JSON]) -> str:
    workers = find(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    env = {e["name"]: e.get("value") for e in workers["template"]["spec"]["containers"][0]["env"]}
    return str(env["HF_HOME"])


def _mounts(container: JSON) -> dict[str, JSON]:
    return {m["name"]: m for m in container.get("volumeMounts") or []}


def test_without_a_shared_cache_the_gateway_fetches_the_hub_tokenizers_to_the_engines_path() -> None:
    docs = render(load_values(CHART_DIR / "ci" / "minimal-values.yaml"))
    gateway = _gateway(docs)
    (fetch,) = gateway["initContainers"]
    hf_home = _engine_hf_home(docs)
    assert {e["name"]: e.get("value") for e in fetch["env"]}["HF_HOME"] == hf_home
    assert _mounts(fetch)["hf-cache"]["mountPath"] == hf_home
    script, *repo_ids = fetch["command"][2:]
    assert repo_ids == ["Qwen/Qwen2.5-0.5B-Instruct"]
    files_line = next(line for line in script.splitlines() if line.strip().startswith("files ="))
    assert tuple(ast.literal_eval(files_line.split("=", 1)[1].strip())) == TOKENIZER_FILES
    # The gateway reads the fetched files at the path the engines' snapshot has, from its own volume.
    (container,) = gateway["containers"]
    assert _mounts(container)["hf-cache"] == {"name": "hf-cache", "mountPath": hf_home, "readOnly": True}
    volumes = {v["name"]: v for v in gateway["volumes"]}
    assert "emptyDir" in volumes["hf-cache"]


def test_with_a_shared_cache_the_gateway_mounts_it_where_the_engines_download() -> None:
    docs = render(load_values(CHART_DIR / "ci" / "gpu-nodes-values.yaml"))
    gateway = _gateway(docs)
    assert "initContainers" not in gateway
    (container,) = gateway["containers"]
    assert _mounts(container)["hf-cache"]["mountPath"] == _engine_hf_home(docs)
    volume = {v["name"]: v for v in gateway["volumes"]}["hf-cache"]
    assert volume["persistentVolumeClaim"] == {"claimName": "hf-cache", "readOnly": True}


def test_a_local_tokenizer_needs_no_cache_in_the_gateway() -> None:
    # model-fetch: a hub-cache model directory, but its tokenizer is a path on the model volume.
    for scenario in ("two-models", "model-fetch"):
        gateway = _gateway(render(load_values(CHART_DIR / "ci" / f"{scenario}-values.yaml")))
        assert "initContainers" not in gateway, scenario
    hub_model_local_tokenizer = {"models": [{"name": "m", "engine": {"model": "Qwen/Qwen2.5-0.5B-Instruct",
                                                                        "tokenizer": "/models/qwen-tokenizer"}}]}
    assert "initContainers" not in _gateway(render(hub_model_local_tokenizer))
