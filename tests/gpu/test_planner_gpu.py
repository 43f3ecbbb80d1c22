"""The planner's bounds against a real GPU: the quick form of scripts/gpu_check_planner.py.

Skipped without CUDA. On a GPU it runs the script's small sizes (no compile, seconds) and checks that no
measurement beats the planner's lower bound or datasheet peak by more than noise, and that each reaches a
sane share of it.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_planner.py"


def load_script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpu_check_planner", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def test_quick_gpu_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script()
    out = tmp_path / "planner-gpu-check.md"
    assert script.main(["--quick", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    ratios = {check["name"]: check["ratio"] for check in report["checks"]}
    assert 0.3 < ratios["HBM copy bandwidth"] < 1.05
    assert 0.2 < ratios["BF16 matmul rate"] < 1.05
    for name, ratio in ratios.items():
        if name.startswith("decode step"):
            assert 0.02 < ratio < 1.1, f"{name}: bound / measured = {ratio}"
    text = out.read_text()
    assert report["meta"]["card"] in text and report["meta"]["date"] in text
