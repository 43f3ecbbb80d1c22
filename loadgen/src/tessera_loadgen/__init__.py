"""Tessera's load generator: multi-tenant open/closed-loop load with honest per-tenant percentiles.

Typical use from Python::

    from tessera_loadgen import Target, execute, load_workload

    workload = load_workload("loadgen/workloads/noisy-neighbour.yaml")
    output = execute(workload, Target.parse("http://127.0.0.1:8000"), Path("runs/x"))
    output.result["summary"]["tenants"]["quiet"]["latency"]["ttft_user_s"]["p99"]

Prompt lengths are in words unless ``execute`` is given tokenizers: ``tokenizers={"tessera-small":
load_model_dir(".tessera/models/tessera-small")}``, or ``resolve_tokenizers("auto", ...)`` for the gateway's.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tessera_loadgen._version import __version__

if TYPE_CHECKING:
    from tessera_loadgen.arrivals import ArrivalProcess, arrival_process_names, make_arrival_process, register
    from tessera_loadgen.client import Target
    from tessera_loadgen.execute import RunOutput, execute
    from tessera_loadgen.metrics import METRICS_VERSION, MetricSpec, SloSpec, summarize, summarize_run
    from tessera_loadgen.mock_server import MockConfig, MockServer
    from tessera_loadgen.records import RequestRecord
    from tessera_loadgen.results import load_result, read_jsonl
    from tessera_loadgen.runner import Runner, RunResult, Shard, run_in_loop
    from tessera_loadgen.tokenizer_source import resolve_tokenizers
    from tessera_loadgen.tokenizer_spec import TokenizerSpec, load_model_dir
    from tessera_loadgen.workload import Arrival, RequestClass, Slo, Tenant, Workload, load_workload

# NOTE: the public names are loaded on first use (PEP 562), not when the package is imported: every
# ``tessera-loadgen`` invocation imports this package first, and ``--help`` or ``validate`` should not pay
# for numpy, uvloop and the HTTP client. Name -> the module that defines it.
_EXPORTS: dict[str, str] = {
    "ArrivalProcess": "tessera_loadgen.arrivals",
    "arrival_process_names": "tessera_loadgen.arrivals",
    "make_arrival_process": "tessera_loadgen.arrivals",
    "register": "tessera_loadgen.arrivals",
    "Target": "tessera_loadgen.client",
    "RunOutput": "tessera_loadgen.execute",
    "execute": "tessera_loadgen.execute",
    "METRICS_VERSION": "tessera_loadgen.metrics",
    "MetricSpec": "tessera_loadgen.metrics",
    "SloSpec": "tessera_loadgen.metrics",
    "summarize": "tessera_loadgen.metrics",
    "summarize_run": "tessera_loadgen.metrics",
    "MockConfig": "tessera_loadgen.mock_server",
    "MockServer": "tessera_loadgen.mock_server",
    "RequestRecord": "tessera_loadgen.records",
    "load_result": "tessera_loadgen.results",
    "read_jsonl": "tessera_loadgen.results",
    "RunResult": "tessera_loadgen.runner",
    "Runner": "tessera_loadgen.runner",
    "Shard": "tessera_loadgen.runner",
    "run_in_loop": "tessera_loadgen.runner",
    "resolve_tokenizers": "tessera_loadgen.tokenizer_source",
    "TokenizerSpec": "tessera_loadgen.tokenizer_spec",
    "load_model_dir": "tessera_loadgen.tokenizer_spec",
    "Arrival": "tessera_loadgen.workload",
    "RequestClass": "tessera_loadgen.workload",
    "Slo": "tessera_loadgen.workload",
    "Tenant": "tessera_loadgen.workload",
    "Workload": "tessera_loadgen.workload",
    "load_workload": "tessera_loadgen.workload",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


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
    "TokenizerSpec",
    "Workload",
    "__version__",
    "arrival_process_names",
    "execute",
    "load_model_dir",
    "load_result",
    "load_workload",
    "make_arrival_process",
    "read_jsonl",
    "register",
    "resolve_tokenizers",
    "run_in_loop",
    "summarize",
    "summarize_run",
]
