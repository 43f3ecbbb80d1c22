"""Coordinated omission: a server stall must show up in user-view latency even when the client could not
send the requests scheduled during the stall until it was over.

The tenant is capped at 2 connections, like a client with a small connection pool. When the mock server
stalls for 1 s, both connections are stuck, so requests scheduled during the stall wait inside the client
and are sent late. Their service-view TTFT (from the late send) looks healthy; their user-view TTFT (from
the intended send time) carries the wait, and so does the schedule lag.
"""

from __future__ import annotations

from collections.abc import Callable

from tessera_loadgen.client import Target
from tessera_loadgen.metrics import summarize_run, ttft_s, ttft_user_s
from tessera_loadgen.runner import Runner, run_in_loop
from tessera_loadgen.workload import Workload

STALL_S = 1.0


def test_stall_shows_in_user_view_ttft_of_requests_sent_late(mock_server: Callable[..., str]) -> None:
    url = mock_server(ttft_s=0.005, stall_after_requests=20, stall_s=STALL_S)
    workload = Workload.model_validate(
        {
            "num_requests": 100,
            "model": "mock-model",
            "tenants": [
                {
                    "name": "t",
                    "arrival": {"process": "constant", "rate_rps": 40},
                    "max_connections": 2,
                    "classes": [{"name": "c", "output_tokens": 4, "prompt": {"tokens": 8}}],
                }
            ],
        }
    )
    result = run_in_loop(Runner(workload, Target.parse(url)).run())
    records = sorted(result.records, key=lambda r: r.t_sched)
    assert all(r.ok for r in records), {r.error_kind for r in records}

    # The stall starts when the 20th request reaches the server. Requests scheduled in the following
    # second were sent late: the client-side wait is their schedule lag.
    stall_start = records[19].t_sched
    during = [r for r in records if stall_start + 0.1 <= r.t_sched <= stall_start + STALL_S - 0.3]
    assert len(during) >= 20
    for r in during:
        assert r.t_send_first is not None
        lag = r.t_send_first - r.t_sched
        user, service = ttft_user_s(r), ttft_s(r)
        assert user is not None and service is not None
        assert lag > 0.2, "requests scheduled during the stall can only be sent after it"
        assert user >= lag + service - 1e-9
        assert service < user / 2, "service view hides most of the wait; user view keeps it"

    overall = summarize_run(records)["overall"]
    assert overall["latency"]["ttft_user_s"]["max"] > 0.6 * STALL_S
    assert overall["latency"]["ttft_user_s"]["p90"] > overall["latency"]["ttft_s"]["p90"]
    assert overall["schedule_lag_s"]["max"] > 0.5 * STALL_S
    assert overall["client_lagging"], "the run must say the client (its pool) was the bottleneck"
