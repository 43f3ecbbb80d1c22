"""Queue depth and other tenants' work from overlapping request intervals (occupancy.py)."""

from __future__ import annotations

import pytest

from tessera.telemetry.occupancy import EngineLoad, GatewayLoad
from tessera.telemetry.spanfile import SpanRecord
from tessera.telemetry.timeline import RequestTimeline, build_timelines
from tests.support.spans_factory import Attempt, Req

MS = 1_000_000


def timelines(*reqs: Req) -> list[RequestTimeline]:
    return build_timelines([SpanRecord.from_dict(d) for r in reqs for d in r.spans()])


def test_depth_counts_running_and_waiting_requests_leaving_the_request_itself_out() -> None:
    # a: waiting [5, 50), running [50, 100); b: running [11, 60); c on another engine.
    a = Req(tenant="x", start=0, attempts=[Attempt(arrival=5, scheduled=50, first_token=80, finished=100)])
    b = Req(tenant="y", start=10, attempts=[Attempt(arrival=0, scheduled=1, first_token=20, finished=50)])
    c = Req(tenant="y", start=10, attempts=[Attempt(engine="e2")])
    ts = timelines(a, b, c)
    load = EngineLoad(ts)
    assert (load.depth_at("e1", 20 * MS).num_running, load.depth_at("e1", 20 * MS).num_waiting) == (1, 1)
    mine = next(t for t in ts if t.tenant == "x").span_id
    assert load.depth_at("e1", 20 * MS, mine).num_total == 1
    assert load.depth_at("e1", 70 * MS).num_running == 1  # b finished at 60
    assert load.depth_at("e1", 200 * MS).num_total == 0
    assert load.depth_at("nope", 0).num_total == 0


def test_work_during_prorates_each_requests_tokens_by_overlap() -> None:
    # Prefill of 100 tokens over [1, 101) ms, decode of 50 tokens over [101, 201) ms.
    other = Req(tenant="noisy", start=0, attempts=[Attempt(arrival=0, scheduled=1, first_token=101, finished=201,
                                                           prompt_tokens=100, cached_tokens=0, output_tokens=50)])
    load = EngineLoad(timelines(other))
    (half,) = load.work_during("e1", 51 * MS, 151 * MS)
    assert (half.tenant, half.num_requests, half.prefill_tokens, half.decode_tokens) == ("noisy", 1, 50, 25)
    assert load.work_during("e1", 300 * MS, 400 * MS) == ()
    assert load.mean_running("e1", 51 * MS, 151 * MS) == pytest.approx(1.0)
    assert load.mean_running("e1", 151 * MS, 251 * MS) == pytest.approx(0.5)


def test_gateway_in_flight_per_tenant() -> None:
    reqs = [Req(tenant="noisy", start=0), Req(tenant="noisy", start=10), Req(tenant="quiet", start=30),
            Req(tenant="quiet", start=500)]
    gateway = GatewayLoad(timelines(*reqs))
    loads = gateway.in_flight_at(40 * MS)
    assert [(x.tenant, x.num_requests) for x in loads] == [("noisy", 2), ("quiet", 1)]
    assert gateway.count_at(40 * MS) == 3
    assert gateway.typical_in_flight() == 0.5  # the median of 0, 1, 2 and 0 others on arrival
