"""The chaos run's schedule and its verdicts (pure: no process, no Redis).

``schedule`` draws, from a seed, when each target dies. ``classify`` sorts one request, from what its client
saw, into one of three outcomes (issue #16):

- ``succeeded``: a complete answer (with ``ignore_eos``: exactly ``max_tokens`` tokens);
- ``failed``: the client was told: an HTTP error status with its error type, an SSE error event, a refused
  connection, a connection closed before any response head, or a 200 stream whose connection closed in the
  middle of its chunked body (every HTTP client raises on each of these: the OpenAI SDK's httpx reports an
  "incomplete chunked read", aiohttp a payload error);
- ``lost``: no answer and no error: a hang (the client's timeout), or a stream that ended cleanly — its body
  complete — short of ``max_tokens``: the only outcomes a client cannot tell from success or cannot end.

NOTE: a SIGKILLed gateway leaves no process to write an SSE error event on its open streams; what the client
gets is the connection closing before the chunked body's last (zero-length) chunk. HTTP/1.1's framing makes
that a protocol error at the client, not a silent truncation, so it counts as failed (reason
``cut_mid_body``), and the bench checks separately that such a request is billed for no more than what the
engine generated.

A lost or failed request is attributed to the outage it overlaps (a kill until the killed part was back),
the latest-starting one when several.

``bill`` compares, per tenant, the completion tokens Redis charged with the tokens the clients received. A
request that did not succeed may be charged for tokens its client never got (generated, then cut), at most
``max_tokens - received`` each: that is the documented bound. Charged above served + bound is double-billed;
charged below served is unbilled.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

SUCCEEDED, FAILED, LOST = "succeeded", "failed", "lost"
TARGETS = ("engine", "gateway", "redis")


@dataclass(frozen=True, slots=True)
class Kill:
    at_s: float  # from the start of the load
    target: str
    back_s: float = 0.0  # how long after the kill the part was serving again (0: unknown or not yet)


def schedule(seed: int, duration_s: float, targets: Sequence[str] = TARGETS,
             recovery_s: Mapping[str, float] | None = None) -> list[Kill]:
    """One kill per target, in a seeded random order, at random times in the middle 70 % of the run, at
    least ``duration_s / (2 * len(targets))`` apart (so each recovery can be told from the next kill), and
    after a target named in ``recovery_s`` at least that long, where the run is long enough for every such
    gap (else the plain gaps: outages then overlap, which the classification shows)."""
    if duration_s <= 0 or not targets:
        raise ValueError("need a positive duration and at least one target")
    rng = random.Random(seed)
    order = list(targets)
    rng.shuffle(order)
    start, end = 0.1 * duration_s, 0.8 * duration_s
    base = duration_s / (2 * len(order))
    gaps = [max(base, (recovery_s or {}).get(t, 0.0)) for t in order[:-1]]
    if sum(gaps) > end - start:
        gaps = [base] * (len(order) - 1)
    # Spread the slack left after the mandatory gaps randomly between the kills.
    slack = max(0.0, end - start - sum(gaps))
    cuts = sorted(rng.uniform(0, slack) for _ in order)
    offsets = [0.0, *itertools.accumulate(gaps)]
    return [Kill(round(start + cut + offset, 3), target)
            for cut, offset, target in zip(cuts, offsets, order, strict=True)]


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the client saw of one request; times in seconds from the start of the load."""

    ok: bool
    error_kind: str | None
    http_status: int | None
    t_send_s: float | None
    t_done_s: float | None
    tokens_received: int
    max_tokens: int
    error_detail: str = ""


@dataclass(frozen=True, slots=True)
class Classified:
    outcome: str  # SUCCEEDED, FAILED or LOST
    reason: str  # e.g. "http_503", "stream_error", "hang", "cut_stream"
    killed: str | None  # the outage the request overlapped, if any


def _killed(outcome: Outcome, kills: Sequence[Kill]) -> str | None:
    if outcome.t_send_s is None or outcome.t_done_s is None:
        return None
    during = [k for k in kills if k.at_s <= outcome.t_done_s and outcome.t_send_s <= k.at_s + k.back_s]
    return max(during, key=lambda k: k.at_s).target if during else None


def _complete(outcome: Outcome) -> bool:
    return outcome.ok and outcome.tokens_received >= outcome.max_tokens


def classify(outcome: Outcome, kills: Sequence[Kill] = ()) -> Classified:
    kind = outcome.error_kind
    if outcome.ok:
        if _complete(outcome):
            return Classified(SUCCEEDED, "complete", None)
        return Classified(LOST, "short_stream", _killed(outcome, kills))
    killed = _killed(outcome, kills)
    if kind is not None and kind.startswith("http_"):
        return Classified(FAILED, kind, killed)
    if kind in ("stream_error", "connect", "bad_response"):
        return Classified(FAILED, kind, killed)
    if kind == "broken_stream":
        # Closed before a response head: the client's call raises (a connection error), nothing hangs.
        if outcome.http_status is None:
            return Classified(FAILED, "closed_before_response", killed)
        # The response head came, its chunked body never ended: the client's HTTP layer raises.
        return Classified(FAILED, "cut_mid_body", killed)
    if kind in ("timeout", "incomplete"):
        return Classified(LOST, "hang", killed)
    return Classified(LOST, kind or "unknown", killed)


@dataclass(frozen=True, slots=True)
class Bill:
    tenant: str
    served_tokens: int  # completion tokens the tenant's clients received
    bound_tokens: int  # what a non-succeeded request may be charged beyond what its client got, summed
    charged_tokens: int  # completion tokens in the tenant's usage in Redis
    served_requests: int
    charged_requests: int

    @property
    def double_billed_tokens(self) -> int:
        return max(0, self.charged_tokens - self.served_tokens - self.bound_tokens)

    @property
    def unbilled_tokens(self) -> int:
        return max(0, self.served_tokens - self.charged_tokens)


def bill(tenant: str, outcomes: Sequence[Outcome], charged_tokens: int, charged_requests: int) -> Bill:
    served = sum(o.tokens_received for o in outcomes)
    bound = sum(max(0, o.max_tokens - o.tokens_received) for o in outcomes if not _complete(o))
    num_ok = sum(1 for o in outcomes if o.ok)
    return Bill(tenant, served, bound, charged_tokens, num_ok, charged_requests)
