"""Phase ``settle``, after the request whatever its end: the span's usage attributes and the metrics (for a
request whose engine call started), then billing. Billing charges at least what was generated, also when the
client went away mid-stream. A request no engine saw (none was live, or every one refused the connection)
is not billed and its admission is undone. When Redis does not answer, the finish waits in
``billing.FinishQueue`` (usage is never lost)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tessera.gateway.metrics import GatewayMetrics
    from tessera.gateway.request.context import RequestContext
    from tessera.tenancy.billing import FinishQueue


async def settle(ctx: RequestContext, metrics: GatewayMetrics, finishes: FinishQueue) -> None:
    result = ctx.result
    if ctx.called:
        stats = result.stats
        ctx.notes.attributes.update({
            "gen_ai.usage.output_tokens": result.completion_tokens,
            "tessera.cached_tokens": int(stats.get("num_cached_tokens", 0)),
            "tessera.preemptions": int(stats.get("num_preemptions", 0)),
            "tessera.retries": result.retries,
            "tessera.engine.final": result.engines_tried[-1] if result.engines_tried else "",
        })
        elapsed_s = time.monotonic() - ctx.t_start
        # The first delta is stamped on the wall clock (it is a span event): TTFT is the elapsed time less
        # the time since that stamp.
        ttft_s = (None if result.first_delta_ns is None
                  else elapsed_s - (time.time_ns() - result.first_delta_ns) / 1e9)
        metrics.completed(ctx.tenant.name, result.completion_tokens, elapsed_s, ttft_s)
    if ctx.lease is None:
        return
    if ctx.called and result.reached_engine:
        await finishes.finish(ctx.lease, ctx.num_prompt_tokens, result.completion_tokens)
    else:
        await finishes.unserved(ctx.lease)
