"""Workload files: strict validation with useful messages, overrides, and the shipped examples."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from tessera_loadgen.distributions import Constant, Uniform
from tessera_loadgen.workload import Workload, load_workload

EXAMPLES = Path(__file__).parents[3] / "loadgen" / "workloads"


def minimal(**tenant: object) -> dict[str, object]:
    base: dict[str, object] = {"name": "t", "arrival": {"rate_rps": 1.0}}
    base.update(tenant)
    return {"num_requests": 10, "tenants": [base]}


def test_minimal_workload_gets_defaults() -> None:
    workload = Workload.model_validate(minimal())
    tenant = workload.tenants[0]
    assert tenant.arrival is not None and tenant.arrival.process == "poisson"
    assert [c.name for c in tenant.classes] == ["default"]
    assert tenant.classes[0].stream is True


def test_unknown_fields_are_errors() -> None:
    with pytest.raises(ValidationError, match="extra"):
        Workload.model_validate(minimal(rate=3))
    with pytest.raises(ValidationError, match="extra"):
        Workload.model_validate(minimal(classes=[{"name": "c", "output_token": 5}]))


def test_unknown_arrival_process_lists_the_valid_ones() -> None:
    with pytest.raises(ValidationError, match="valid: constant, gamma, poisson"):
        Workload.model_validate(minimal(arrival={"process": "pareto", "rate_rps": 1}))


def test_burstiness_only_with_gamma() -> None:
    with pytest.raises(ValidationError, match="gamma"):
        Workload.model_validate(minimal(arrival={"process": "poisson", "rate_rps": 1, "burstiness": 0.5}))
    Workload.model_validate(minimal(arrival={"process": "gamma", "rate_rps": 1, "burstiness": 0.5}))


def test_exactly_one_of_arrival_and_concurrency() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        Workload.model_validate(minimal(concurrency=2))
    with pytest.raises(ValidationError, match="exactly one"):
        Workload.model_validate({"num_requests": 1, "tenants": [{"name": "t"}]})


def test_a_limit_is_required_and_names_are_unique() -> None:
    with pytest.raises(ValidationError, match="duration_s or num_requests"):
        Workload.model_validate({"tenants": [{"name": "t", "concurrency": 1}]})
    twice = {"num_requests": 1, "tenants": [{"name": "t", "concurrency": 1}, {"name": "t", "concurrency": 1}]}
    with pytest.raises(ValidationError, match="duplicate tenant"):
        Workload.model_validate(twice)


def test_distributions_accept_bare_numbers_and_mappings() -> None:
    workload = Workload.model_validate(
        minimal(
            classes=[
                {
                    "name": "c",
                    "output_tokens": 64,
                    "prompt": {"tokens": {"kind": "uniform", "low": 5, "high": 9}},
                }
            ]
        )
    )
    request_class = workload.tenants[0].classes[0]
    assert request_class.output_tokens == Constant(value=64)
    assert isinstance(request_class.prompt.tokens, Uniform)
    rng = random.Random(0)
    assert {request_class.prompt.tokens.sample_int(rng) for _ in range(200)} == set(range(5, 10))
    with pytest.raises(ValidationError, match="high"):
        Workload.model_validate(
            minimal(classes=[{"name": "c", "output_tokens": {"kind": "uniform", "low": 9, "high": 5}}])
        )


def test_unknown_prefix_group_and_session_on_completions_are_errors() -> None:
    with pytest.raises(ValidationError, match="unknown prefix group 'sys'"):
        Workload.model_validate(minimal(classes=[{"name": "c", "prompt": {"prefix_group": "sys"}}]))
    with pytest.raises(ValidationError, match="sessions need endpoint 'chat'"):
        Workload.model_validate(minimal(classes=[{"name": "c", "endpoint": "completions", "session": {"turns": 2}}]))


def test_with_total_rate_keeps_the_mix_and_leaves_closed_loop_alone() -> None:
    workload = Workload.model_validate(
        {
            "num_requests": 5,
            "tenants": [
                {"name": "a", "arrival": {"rate_rps": 1}},
                {"name": "b", "arrival": {"rate_rps": 3}},
                {"name": "c", "concurrency": 2},
            ],
        }
    )
    scaled = workload.with_total_rate(40)
    rates = [t.arrival.rate_rps if t.arrival else None for t in scaled.tenants]
    assert rates == [10, 30, None]
    assert scaled.open_loop_rate_rps() == 40
    assert workload.open_loop_rate_rps() == 4  # the original is unchanged


def test_keys_from_overrides_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    workload = Workload.model_validate(minimal(api_key_env="TESSERA_TEST_KEY"))
    with pytest.raises(ValueError, match="TESSERA_TEST_KEY"):
        workload.tenants[0].resolved_api_key()
    monkeypatch.setenv("TESSERA_TEST_KEY", "from-env")
    assert workload.tenants[0].resolved_api_key() == "from-env"
    assert workload.with_keys({"t": "k1"}).tenants[0].resolved_api_key() == "k1"
    with pytest.raises(ValueError, match="no tenant 'x'"):
        workload.with_keys({"x": "k"})
    assert workload.with_keys({"t": "secret"}).redacted()["tenants"][0]["api_key"] == "***"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_example_workloads_are_valid(path: Path) -> None:
    workload = load_workload(path)
    assert len(workload.tenants) >= 2


def test_examples_cover_the_documented_scenarios() -> None:
    names = {p.stem for p in EXAMPLES.glob("*.yaml")}
    assert {"noisy-neighbour", "shared-prefix", "multi-turn-chat"} <= names


def test_relative_sharegpt_paths_resolve_against_the_workload_file(tmp_path: Path) -> None:
    (tmp_path / "w.yaml").write_text(
        "num_requests: 1\ntenants:\n  - name: t\n    concurrency: 1\n    classes:\n"
        "      - name: c\n        prompt: {source: sharegpt, path: data/sg.json}\n"
    )
    workload = load_workload(tmp_path / "w.yaml")
    assert workload.tenants[0].classes[0].prompt.path == str(tmp_path / "data" / "sg.json")
