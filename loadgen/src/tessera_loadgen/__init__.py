"""Tessera's load generator: multi-tenant open/closed-loop load with honest per-tenant percentiles.

Typical use from Python::

    from tessera_loadgen import Target, execute, load_workload

    workload = load_workload("loadgen/workloads/noisy-neighbour.yaml")
    output = execute(workload, Target.parse("http://127.0.0.1:8000"), Path("runs/x"))
    output.result["summary"]["tenants"]["quiet"]["latency"]["ttft_user_s"]["p99"]
"""

from tessera_loadgen._version import __version__
from tessera_loadgen.arrivals import ArrivalProcess, arrival_process_names, make_arrival_process, register
from tessera_loadgen.client import Target
from tessera_loadgen.execute import RunOutput, execute
from tessera_loadgen.metrics import METRICS_VERSION, MetricSpec, SloSpec, summarize, summarize_run
from tessera_loadgen.mock_server import MockConfig, MockServer
from tessera_loadgen.records import RequestRecord
from tessera_loadgen.results import load_result, read_jsonl
from tessera_loadgen.runner import Runner, RunResult, Shard, run_in_loop
from tessera_loadgen.workload import Arrival, RequestClass, Slo, Tenant, Workload, load_workload

__all__ = [
    "METRICS_VERSION",
    "Arrival",
    "ArrivalProcess",
    "MetricSpec",
    "MockConfig",
    "MockServer",
    "RequestClass",
    "RequestRecord",
    "RunOutput",
    "RunResult",
    "Runner",
    "Shard",
    "Slo",
    "SloSpec",
    "Target",
    "Tenant",
    "Workload",
    "__version__",
    "arrival_process_names",
    "execute",
    "load_result",
    "load_workload",
    "make_arrival_process",
    "read_jsonl",
    "register",
    "run_in_loop",
    "summarize",
    "summarize_run",
]
