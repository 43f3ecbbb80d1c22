"""``validate`` warns when a class's longest request cannot fit the model's context (max_model_len)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tessera_loadgen.cli import main
from tessera_loadgen.context_check import class_lengths, context_overflows
from tessera_loadgen.workload import RequestClass, Workload

WORKLOADS = Path(__file__).resolve().parents[3] / "loadgen" / "workloads"


def request_class(**fields: Any) -> RequestClass:
    return RequestClass.model_validate({"name": "c", **fields})


def test_class_lengths_take_the_largest_values() -> None:
    lengths = class_lengths(
        request_class(prompt={"tokens": {"kind": "uniform", "low": 600, "high": 1200}}, output_tokens=512), 0
    )
    assert lengths is not None
    assert (lengths.prompt_tokens, lengths.output_tokens, lengths.total_tokens, lengths.bounded) == (
        1200,
        512,
        1712,
        True,
    )


def test_unbounded_distributions_count_with_their_p99_9() -> None:
    lengths = class_lengths(request_class(prompt={"tokens": {"kind": "lognormal", "median": 200, "sigma": 0.5}}), 0)
    assert lengths is not None and not lengths.bounded
    assert lengths.prompt_tokens == pytest.approx(200 * 4.68, rel=0.01)  # exp(0.5 * 3.09)


def test_sessions_count_the_whole_history_of_their_last_turn() -> None:
    lengths = class_lengths(request_class(prompt={"tokens": 100}, output_tokens=50, session={"turns": 3}), 30)
    assert lengths is not None
    # prefix + three questions + the two answers before the last question; then the last answer.
    assert (lengths.prompt_tokens, lengths.output_tokens, lengths.num_turns) == (30 + 3 * 100 + 2 * 50, 50, 3)


def test_sharegpt_classes_are_not_checked() -> None:
    assert class_lengths(request_class(prompt={"source": "sharegpt", "path": "x.json"}), 0) is None


def workload(classes: list[dict[str, Any]]) -> Workload:
    return Workload.model_validate(
        {
            "num_requests": 1,
            "prefix_groups": {"long": {"prefix_tokens": 1800}},
            "tenants": [{"name": "t", "arrival": {"rate_rps": 1}, "classes": classes}],
        }
    )


def test_overflows_name_the_class_and_the_numbers() -> None:
    w = workload(
        [
            {"name": "fits", "prompt": {"tokens": 1000}, "output_tokens": 1000},
            {"name": "prefixed", "prompt": {"tokens": 100, "prefix_group": "long"}, "output_tokens": 200},
        ]
    )
    overflows = context_overflows(w, {"t": 2048}, {"t": "tessera-small"})
    assert [o.request_class for o in overflows] == ["prefixed"]
    message = overflows[0].message()
    assert "'prefixed'" in message and "1900 + max_tokens up to 200 = 2100" in message
    assert "max_model_len 2048 of tessera-small" in message
    assert context_overflows(w, {}) == []  # no known context: nothing to say


def write(tmp_path: Path, classes: list[dict[str, Any]]) -> Path:
    path = tmp_path / "w.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "num_requests": 1,
                "tenants": [{"name": "noisy", "arrival": {"rate_rps": 1}, "classes": classes}],
            }
        )
    )
    return path


def test_validate_warns_with_max_model_len(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path,
        [{"name": "batch", "prompt": {"tokens": {"kind": "uniform", "low": 600, "high": 1200}}, "output_tokens": 1024}],
    )
    assert main(["validate", str(path), "--max-model-len", "2048"]) == 0
    out = capsys.readouterr()
    assert "warning: tenant 'noisy' class 'batch': prompt up to 1200 + max_tokens up to 1024 = 2224" in out.err
    assert "1 class can exceed it" in out.out


def test_validate_reads_the_context_of_a_model_dir(
    tmp_path: Path, small_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, [{"name": "huge", "prompt": {"tokens": 9000}}])
    assert main(["validate", str(path), "--tokenizer", str(small_model_dir)]) == 0
    out = capsys.readouterr()
    assert "max_model_len 8192" in out.out and "'huge'" in out.err


def test_validate_without_a_context_says_it_did_not_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(write(tmp_path, [{"name": "c"}]))]) == 0
    assert "context lengths not checked: pass --max-model-len N" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["noisy-neighbour.yaml", "shared-prefix.yaml"])
def test_shipped_workloads_fit_the_local_platforms_context(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``make run`` serves the small model with max_model_len 2048."""
    assert main(["validate", str(WORKLOADS / name), "--max-model-len", "2048"]) == 0
    out = capsys.readouterr()
    assert "every class fits" in out.out and "warning" not in out.err
