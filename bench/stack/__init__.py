"""``make bench-stack`` (bench/bench_stack.py), one concept per module: ``stacks`` starts each stack under
test, ``workload`` is the one client, ``cpu`` measures each part's CPU, ``report`` turns phases into tables."""

from . import cpu, report, stacks, workload

__all__ = ["cpu", "report", "stacks", "workload"]
