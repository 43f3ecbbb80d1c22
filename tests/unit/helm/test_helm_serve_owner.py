"""serveConfigV2 has one owner (templates/_serve.tpl): the operator when it is enabled (the chart renders the
models as Model objects and no serveConfigV2), else the chart. tests/integration/operator/
test_serve_config_owner.py runs the operator's handlers through an install and an upgrade."""

from __future__ import annotations

from tests.support.chart import CHART_DIR, find, load_values, render, serve_config
from tests.support.fake_kube import merge_patch
from tests.support.helm_upgrade import three_way_merge_patch


def test_with_the_operator_the_chart_renders_models_and_no_serve_config() -> None:
    values = load_values(CHART_DIR / "ci" / "pvc-model-values.yaml")
    docs = render(values)
    assert "serveConfigV2" not in find(docs, "RayService")["spec"]
    models = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Model"}
    assert list(models) == [m["name"] for m in values["models"]]
    for entry in values["models"]:
        model = models[entry["name"]]
        assert model["apiVersion"] == "tessera.dev/v1alpha1"
        assert model["metadata"]["labels"]["app.kubernetes.io/component"] == "model"
        assert model["spec"]["replicas"] == entry.get("replicas", 1)
        # Only the chart resolves pvc:// paths: the Model names the path where the claim is mounted.
        assert not model["spec"]["engine"]["model"].startswith("pvc://")


def test_without_the_operator_the_chart_owns_the_serve_config() -> None:
    values = {**load_values(CHART_DIR / "ci" / "two-models-values.yaml"), "operator": {"enabled": False}}
    docs = render(values)
    assert [d for d in docs if d["kind"] == "Model"] == []
    chart_owned = serve_config(docs)
    operator_owned = serve_config(render(load_values(CHART_DIR / "ci" / "two-models-values.yaml")))
    # Either owner serves the same applications for the same values.
    assert chart_owned == operator_owned


def test_an_upgrade_patch_never_touches_the_serve_config() -> None:
    """Whatever changes between releases, Helm's patch of the RayService has no serveConfigV2 in it."""
    old = find(render(), "RayService")
    new_values = load_values(CHART_DIR / "ci" / "production-external-redis-values.yaml")
    new = find(render(new_values), "RayService")
    live = merge_patch(old, {"spec": {"serveConfigV2": "applications: [{name: from-a-model}]\n"}})
    patch = three_way_merge_patch(old, new, live)
    assert patch["spec"] and "serveConfigV2" not in patch["spec"]
    assert merge_patch(live, patch)["spec"]["serveConfigV2"] == live["spec"]["serveConfigV2"]
