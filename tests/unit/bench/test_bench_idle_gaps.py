"""The pure parts of ``make bench-idle-gaps`` (bench/bench_idle_gaps.py): arm parsing and the per-gap summary.
Starts no server."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from bench_idle_gaps import Arm, summarise
from stack.workload import Sample


def test_an_arm_names_its_stack_and_its_own_environment() -> None:
    assert Arm.parse("tessera") == Arm("tessera", {})
    arm = Arm.parse("tessera:OMP_WAIT_POLICY=PASSIVE,GOMP_SPINCOUNT=0")
    assert arm == Arm("tessera", {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0"})
    assert arm.label() == "tessera OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=0"
    assert Arm.parse("vllm:OMP_WAIT_POLICY=").env == {"OMP_WAIT_POLICY": ""}  # empty: libgomp's default wait


@pytest.mark.parametrize(("text", "says"), [("sglang", "vllm or tessera"), ("tessera:GOMP_SPINCOUNT", "NAME=VALUE"),
                                            ("vllm:=1", "NAME=VALUE"), ("tessera:A=1,B", "NAME=VALUE")])
def test_a_bad_arm_says_what_to_write(text: str, says: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        Arm.parse(text)


def test_a_gap_is_summarised_by_its_medians_and_cpu_per_request() -> None:
    timelines = [(0.010, 0.020, 0.050), (0.030, 0.040, 0.090), (0.020, 0.025, 0.060)]
    samples = [Sample(True, t[0], t[-1] + 0.001, text_arrivals_s=t) for t in timelines]
    row = summarise(samples, cpu_s=0.3)
    assert row["ttft_p50_ms"] == pytest.approx(20.0)
    assert row["decode_p50_ms"] == pytest.approx(40.0)  # last token minus first: 40, 60, 40 ms
    assert row["e2e_p50_ms"] == pytest.approx(61.0)  # the stream's end, after its last text
    assert row["cpu_ms_per_request"] == pytest.approx(100.0)
