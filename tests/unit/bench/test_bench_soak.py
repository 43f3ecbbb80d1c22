"""The soak's judge (bench/longrun/soak.py) and its windowing (bench/bench_soak.py's build_windows): pure,
no process started."""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from longrun.load import cache_fill_workload
from longrun.soak import KEY_SETTLE_S, P99_RATIO_LIMIT, Window, judge, readings

MIB = 2**20


def window(index: int, *, p99: float = 0.1, gw: int = 100 * MIB, engine: int = 1000 * MIB, keys: int = 500,
           end_s: float | None = None, tenants: dict[str, float] | None = None,
           tenants_p95: dict[str, float] | None = None) -> Window:
    return Window(index=index, end_s=(index + 1) * 300.0 if end_s is None else end_s, gateway_rss_bytes=gw,
                  engine_rss_bytes=engine, redis_keys=keys, redis_used_memory_bytes=MIB, redis_clients=10,
                  gateway_sockets=20, num_requests=100, num_failed=0, ttft_p50_s=p99 / 2, ttft_p99_s=p99,
                  tenant_ttft_p99_s=tenants or {},
                  tenant_ttft_p95_s=tenants_p95 if tenants_p95 is not None else dict(tenants or {}))


def verdicts(windows: list[Window]) -> dict[str, bool | None]:
    return {v.goal: v.passed for v in judge(windows)}


def test_a_flat_soak_passes_every_goal() -> None:
    got = verdicts([window(i, tenants={"a": 0.1, "b": 0.2}) for i in range(6)])
    assert got == {"ttft_p99": True, "ttft_p95[a]": True, "ttft_p95[b]": True, "gateway_rss_growth": True,
                   "engine_rss_growth": True, "redis_keys_bounded": True}


def test_p99_limit_is_relative_to_the_first_window_exactly() -> None:
    at_limit = [window(0, p99=0.100), window(1, p99=0.100 * P99_RATIO_LIMIT)]
    above = [window(0, p99=0.100), window(1, p99=0.100 * P99_RATIO_LIMIT * 1.01)]
    assert verdicts(at_limit)["ttft_p99"] is True
    assert verdicts(above)["ttft_p99"] is False


def test_one_tenants_p95_fails_alone() -> None:
    windows = [window(0, tenants={"a": 0.1, "b": 0.1}), window(1, tenants={"a": 0.1, "b": 0.5})]
    got = verdicts(windows)
    assert got["ttft_p95[a]"] is True and got["ttft_p95[b]"] is False


def test_a_tenants_p99_is_a_reading_beside_the_goals_not_one() -> None:
    # Tenant b's few slowest requests of window 1 doubled its p99; its p95 did not move.
    windows = [window(0, tenants={"a": 0.1, "b": 0.1}), window(1, tenants={"a": 0.1, "b": 0.2},
                                                               tenants_p95={"a": 0.05, "b": 0.05})]
    got = verdicts(windows)
    assert got["ttft_p95[b]"] is True and "ttft_p99[b]" not in got
    assert {v.goal: v.passed for v in readings(windows)} == {"ttft_p99[a]": True, "ttft_p99[b]": False}


def test_rss_growth_of_five_percent_fails_and_below_passes() -> None:
    assert verdicts([window(0, gw=100 * MIB), window(1, gw=int(104.9 * MIB))])["gateway_rss_growth"] is True
    assert verdicts([window(0, gw=100 * MIB), window(1, gw=105 * MIB)])["gateway_rss_growth"] is False
    assert verdicts([window(0, engine=1000 * MIB), window(1, engine=1100 * MIB)])["engine_rss_growth"] is False


def test_keys_are_not_judged_before_their_ttl_has_passed() -> None:
    short = [window(i, end_s=60.0 * (i + 1), keys=100 * (i + 1)) for i in range(4)]
    assert verdicts(short)["redis_keys_bounded"] is None


def test_keys_growing_after_the_settle_time_fail() -> None:
    grown = [window(0, end_s=KEY_SETTLE_S, keys=1000), window(1, end_s=KEY_SETTLE_S + 300, keys=1000),
             window(2, end_s=KEY_SETTLE_S + 600, keys=1300)]
    flat = [window(0, end_s=KEY_SETTLE_S, keys=1000), window(1, end_s=KEY_SETTLE_S + 300, keys=1140)]
    assert verdicts(grown)["redis_keys_bounded"] is False
    assert verdicts(flat)["redis_keys_bounded"] is True  # 1000 * 1.1 + 50


def test_a_single_window_or_no_ttft_is_not_judged() -> None:
    assert verdicts([window(0)])["ttft_p99"] is None
    assert verdicts([window(0, p99=math.nan), window(1)])["ttft_p99"] is None


def test_windows_take_the_requests_scheduled_in_them_and_skip_the_warm_up() -> None:
    from types import SimpleNamespace

    from bench_soak import build_windows

    def record(t_sched: float, ttft: float | None, tenant: str = "a", warmup: bool = False) -> SimpleNamespace:
        return SimpleNamespace(t_sched=t_sched, warmup=warmup, tenant=tenant, ok=ttft is not None,
                               t_first=None if ttft is None else t_sched + ttft)

    sample = {"at_s": 0.0, "gateway_rss_bytes": 1, "engine_rss_bytes": 2, "redis_keys": 3,
              "redis_used_memory_bytes": 4, "redis_clients": 5, "gateway_sockets": 6}
    records = [record(100.0, 9.0, warmup=True), record(101.0, 0.5), record(109.9, 0.1, "b"), record(111.0, None),
               record(115.0, 0.2), record(125.0, 0.3)]  # the last is past the two windows: dropped
    first, second = build_windows(records, t_measure=100.0, window_s=10.0,
                                  samples=[{**sample, "at_s": 9.2}, {**sample, "at_s": 19.2}])
    assert (first.num_requests, first.num_failed, second.num_requests, second.num_failed) == (2, 0, 2, 1)
    assert set(first.tenant_ttft_p99_s) == set(first.tenant_ttft_p95_s) == {"a", "b"}
    assert second.ttft_p50_s == pytest.approx(0.2)
    # A window's end_s is when its sample was taken (a quiet moment before its end), for the keys' settling.
    assert (first.end_s, second.end_s, second.redis_keys) == (9.2, 19.2, 3)
    untimed = {k: v for k, v in sample.items() if k != "at_s"}
    assert [w.end_s for w in build_windows(records, t_measure=100.0, window_s=10.0, samples=[untimed])] == [10.0]


def test_the_cache_fill_stores_the_asked_multiple_of_the_cache_one_request_at_a_time_per_tenant() -> None:
    keys = {"soak-a": "ka", "soak-b": "kb", "soak-c": "kc"}
    fill = cache_fill_workload(keys, kv_blocks=1024, block_size=32, times=2.0, prompt_tokens=896, seed=1)
    assert fill.num_requests is not None
    # 2 x 1,024 blocks x 32 tokens in 896-token prompts: 74 prompts (73.1 rounded up), never fewer.
    assert fill.num_requests == 74 and fill.num_requests * 896 >= 2 * 1024 * 32
    assert [t.name for t in fill.tenants] == list(keys) and all(t.concurrency == 1 for t in fill.tenants)
    request_class = fill.tenants[0].classes[0]
    assert request_class.endpoint == "completions" and request_class.prompt.tokens.sample(random.Random(0)) == 896
    # A tiny cache still sends each tenant one prompt.
    assert cache_fill_workload(keys, kv_blocks=1, block_size=32, times=1.0, prompt_tokens=896,
                               seed=1).num_requests == 3


def test_flat_failure_chances_per_goal_from_the_windows_requests() -> None:
    from types import SimpleNamespace

    from bench_soak import flat_failure_chances

    rng = random.Random(2)
    records = [SimpleNamespace(t_sched=100.0 + i * 0.05, warmup=False, ok=True, tenant="ab"[i % 2],
                               t_first=100.0 + i * 0.05 + rng.lognormvariate(-4.0, 0.5)) for i in range(2400)]
    records.append(SimpleNamespace(t_sched=99.0, warmup=True, ok=True, tenant="a", t_first=199.0))  # warm-up
    chances = flat_failure_chances(records, t_measure=100.0, window_s=30.0, num_windows=4)
    assert set(chances) == {"ttft_p99", "ttft_p95[a]", "ttft_p95[b]", "ttft_p99[a]", "ttft_p99[b]"}
    # Each tenant's windows hold half the requests: its p99 is noisier, so a flat run fails its rule more often;
    # its p95 (the goal per tenant) less often than its p99.
    assert chances["ttft_p99"] < min(chances["ttft_p99[a]"], chances["ttft_p99[b]"])
    assert chances["ttft_p95[a]"] < chances["ttft_p99[a]"] and chances["ttft_p95[b]"] < chances["ttft_p99[b]"]
    # A scope with an empty window gets no figure.
    assert "ttft_p99[a]" not in flat_failure_chances([r for r in records if not (r.tenant == "a" and r.t_sched >= 190)],
                                                     t_measure=100.0, window_s=30.0, num_windows=4)


def test_each_windows_cpu_row_ends_with_the_machines_yardstick_against_the_first_window() -> None:
    from bench_soak import CPU_PARTS, cpu_rows

    def taken(cpu: float, yardstick: float | None) -> dict[str, object]:
        sample: dict[str, object] = {"cpu_s": {**dict.fromkeys(CPU_PARTS, cpu), "machine_busy": cpu * len(CPU_PARTS)}}
        if yardstick is not None:
            sample["yardstick_ms"] = yardstick
        return sample

    before = taken(0.0, None)
    rows = cpu_rows(before, [taken(1.0, 8.0), taken(2.0, 10.0)], [window(0), window(1)])
    # 1 s of each part over a window's 100 requests: 10 ms each; the second window's fixed work took 1.25x.
    assert rows[0][1:7] == ["10.0"] * 6 and rows[0][-1] == "8.00 (1.00x)" and rows[1][-1] == "10.00 (1.25x)"
    # A run from before the yardstick (no figure in its samples) prints none.
    assert cpu_rows(before, [taken(1.0, None)], [window(0)])[0][-1] == "–"


def test_the_yardstick_is_a_positive_cpu_time_of_the_same_work_each_time() -> None:
    from longrun import machine_speed

    assert machine_speed._fixed_work() == 10_007  # the same dict and sort every call
    assert 0 < machine_speed.fixed_work_ms(repeats=2) < 1_000


def test_the_yardstick_sampler_gives_each_window_the_median_of_its_probes() -> None:
    from longrun.machine_speed import YardstickSampler

    sampler = YardstickSampler(every_s=0.01).start()
    try:
        deadline = time.monotonic() + 5.0
        while True:
            with sampler._lock:
                num_probes = len(sampler._probes)
            if num_probes >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert num_probes >= 3
        first = sampler.take()
        assert first is not None and first > 0
    finally:
        sampler.stop()
    assert not sampler._thread.is_alive()
    # Stopped, it probes no more: a take is the median of what it holds, and then there is nothing.
    with sampler._lock:
        sampler._probes[:] = [1.0, 9.0, 2.0]
    assert sampler.take() == 2.0
    assert sampler.take() is None
