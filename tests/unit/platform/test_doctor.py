"""``tessera doctor``'s readings: parsed from the machine's own files, problems only where Tessera cannot run."""

from __future__ import annotations

import socket

from tessera.doctor import (
    cpu_findings,
    memory_findings,
    native_step_finding,
    port_findings,
    redis_findings,
)
from tessera.native_steps import NATIVE_STEPS

AVX2_EPYC = """processor\t: 0
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma bmi2
"""
SAPPHIRE_RAPIDS = """model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni amx_tile amx_bf16 amx_int8
"""


def test_cpu_flags_vllm_cares_about_and_the_fp8_note() -> None:
    (epyc,) = cpu_findings(AVX2_EPYC, 2)
    assert "AMD EPYC 7B13, 2 usable cores" in epyc.seen and "flags: avx2 (" in epyc.seen
    assert "FP8 KV does not run on this CPU" in epyc.seen and epyc.problem is None  # it falls back; not fatal
    (xeon,) = cpu_findings(SAPPHIRE_RAPIDS, 8)
    assert "avx512f" in xeon.seen and "amx_tile" in xeon.seen and "FP8" not in xeon.seen
    (unknown,) = cpu_findings("", 1)
    assert "unknown model" in unknown.seen and "none of them" in unknown.seen


def test_low_memory_is_a_problem() -> None:
    (ok,) = memory_findings("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    assert ok.problem is None and "19.1 GiB available" in ok.seen
    (low,) = memory_findings("MemTotal:       4000000 kB\nMemAvailable:   1000000 kB\n")
    assert low.problem is not None and "VLLM_CPU_KVCACHE_SPACE" in low.problem


def test_unreachable_redis_is_a_problem_without_its_password() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        (finding,) = redis_findings(f"redis://:s3cret@127.0.0.1:{port}/0")
    assert finding.problem is not None and "not reachable" in finding.problem
    assert "s3cret" not in finding.seen and "***@127.0.0.1" in finding.seen


def test_a_sentinel_url_is_checked_through_its_sentinels() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        (finding,) = redis_findings(f"redis+sentinel://:s3cret@127.0.0.1:{port}/tessera/0")
    assert finding.problem is not None and "No master found for 'tessera'" in finding.problem
    assert "s3cret" not in finding.seen


def test_a_busy_gateway_port_is_a_problem() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        busy = sock.getsockname()[1]
        gateway, ranges = port_findings(busy)
    assert gateway.problem is not None and "--port" in gateway.problem
    assert ranges.problem is None and "engine HTTP" in ranges.seen


def test_the_gateways_c_steps_are_named_and_never_a_problem() -> None:
    for step in NATIVE_STEPS:
        built = native_step_finding(step, native_built=True, forced_off=False)
        assert built.area == "gateway" and "in C" in built.seen and step.source in built.seen and built.problem is None
        missing = native_step_finding(step, native_built=False, forced_off=False)
        assert "in Python" in missing.seen and "C compiler" in missing.seen and missing.problem is None
        off = native_step_finding(step, native_built=True, forced_off=True)
        assert f"{step.env}=0" in off.seen and off.problem is None

