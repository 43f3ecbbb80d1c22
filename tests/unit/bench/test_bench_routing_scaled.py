"""bench_routing's sim backend at fleet scale (``--sim-engines``): the workload grows with the fleet so each
engine's cache against its share of the system prompts, and its share of the arrivals, stay the 3-engine
sweep's; the option is refused where it means nothing. No process started."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import bench_routing


@pytest.mark.parametrize("num_engines", [3, 16, 64, 256])
def test_the_scaled_workload_keeps_four_system_prompts_an_engine(num_engines: int) -> None:
    workload = bench_routing.scaled_workload(num_engines)
    prompts = workload.tenants * workload.prompts_per_tenant
    assert prompts >= bench_routing.SYSTEM_PROMPTS_PER_ENGINE * num_engines
    assert prompts < bench_routing.SYSTEM_PROMPTS_PER_ENGINE * num_engines + workload.tenants
    assert workload.tenants >= bench_routing.WORKLOAD.tenants


def test_three_engines_is_the_default_sweep_and_64_the_documented_recipe() -> None:
    assert bench_routing.scaled_workload(bench_routing.NUM_ENGINES) == bench_routing.WORKLOAD
    sixty_four = bench_routing.scaled_workload(64)
    assert (sixty_four.tenants, sixty_four.prompts_per_tenant) == (16, 16)


def test_a_regimes_cache_share_is_the_same_at_every_fleet_size() -> None:
    regime = bench_routing.Regime("overloaded", "tight", 1.0, bench_routing.KV_LEVELS["tight"])
    shares = {n: bench_routing.regime_setup(regime, "sim", 1.0, 1, 100, n, bench_routing.scaled_workload(n))
              ["kv_share_of_working_set"] for n in (3, 64, 256)}
    assert shares[64] == pytest.approx(shares[3]) and shares[256] == pytest.approx(shares[3])


def test_sim_engines_is_refused_for_real_engines_and_out_of_range() -> None:
    assert bench_routing.parse_args(["--backend", "sim", "--sim-engines", "64"]).sim_engines == 64
    with pytest.raises(SystemExit):
        bench_routing.parse_args(["--sim-engines", "64"])
    with pytest.raises(SystemExit):
        bench_routing.parse_args(["--backend", "sim", "--sim-engines", "0"])


def test_the_sweep_pools_sixteen_sequences_at_three_engines_and_four_at_fleet_scale() -> None:
    # Sixteen at 3 engines: with four, an overloaded regime's p99 was one sequence's cold start (docs/routing.md,
    # "The sweep's sample"); at fleet scale each sequence already holds engines/3 times the requests.
    assert bench_routing.parse_args(["--backend", "sim"]).sim_sequences == 16
    assert bench_routing.parse_args(["--backend", "sim", "--sim-engines", "64"]).sim_sequences == 4
    chosen = bench_routing.parse_args(["--backend", "sim", "--sim-engines", "64", "--sim-sequences", "8"])
    assert chosen.sim_sequences == 8
