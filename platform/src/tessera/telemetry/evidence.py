"""The evidence behind one cause of one slow request: the numbers a person checks the attribution against.

Every cause the analyzer assigns comes with an ``Evidence``: which explanation of that cause the numbers
support (``kind``: a slow prefill may be a long prompt, a cold prefix, a busy batch…), one line for a person
(``summary``), the numbers themselves with their units in their names (``facts``), the other tenants' load
where the request waited (``neighbours``) and, when one other tenant accounts for most of that load or
evicted the prefix, its name (``culprit``). The JSON report carries all of it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from tessera.telemetry.occupancy import TenantLoad

Fact: TypeAlias = int | float | str | dict[str, int]

# Another tenant is named the culprit when its share of the load where the request waited is at least this.
CULPRIT_SHARE = 0.5
# The batch was busy when the other requests' tokens were at least this share of all the tokens the engine
# computed while this request waited or ran (a step's cost grows with the tokens in it, whoever owns them).
BUSY_SHARE = 0.2


@dataclass(frozen=True, slots=True)
class Evidence:
    cause: str
    kind: str
    summary: str
    facts: Mapping[str, Fact] = field(default_factory=dict)
    neighbours: tuple[TenantLoad, ...] = ()
    culprit: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause, "kind": self.kind, "summary": self.summary, "culprit": self.culprit or None,
            "facts": {k: round(v, 6) if isinstance(v, float) else v for k, v in self.facts.items()},
            "neighbours": [{"tenant": n.tenant, "num_requests": n.num_requests, "prefill_tokens": n.prefill_tokens,
                            "decode_tokens": n.decode_tokens} for n in self.neighbours],
        }


def culprit_of(own_tenant: str, loads: Sequence[TenantLoad], by_tokens: bool = True) -> tuple[str, float]:
    """The other tenant with the largest load, and its share of all the load (the request's own tenant's other
    requests included); ("", share) when that share is below CULPRIT_SHARE or there is no load. Weighed by
    tokens computed (an engine's work), or by requests (``by_tokens=False``: the gateway's in-flight)."""

    def weight(load: TenantLoad) -> float:
        return float(load.tokens if by_tokens else load.num_requests)

    total = sum(weight(x) for x in loads)
    others = [x for x in loads if x.tenant != own_tenant]
    if total <= 0 or not others:
        return "", 0.0
    top = max(others, key=weight)
    share = weight(top) / total
    return (top.tenant if share >= CULPRIT_SHARE and weight(top) > 0 else ""), share


def ms(seconds: float) -> str:
    """Seconds as a person reads a latency: ``412 ms``, ``1.85 s``."""
    if seconds >= 10:
        return f"{seconds:.1f} s"
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1000:.0f} ms" if seconds >= 0.01 else f"{seconds * 1000:.1f} ms"


def loads_text(loads: Sequence[TenantLoad], by_tokens: bool = True, limit: int = 3) -> str:
    """``noisy 3 req/2,980 tok, quiet 1 req/40 tok`` (the heaviest first)."""
    if not loads:
        return "nothing else"
    parts = [f"{x.tenant or '?'} {x.num_requests} req" + (f"/{x.tokens:,} tok" if by_tokens else "")
             for x in loads[:limit]]
    if len(loads) > limit:
        parts.append(f"+{len(loads) - limit} tenant(s)")
    return ", ".join(parts)


def others_tokens(loads: tuple[TenantLoad, ...]) -> int:
    return sum(x.tokens for x in loads)


def busy(others: int, own_tokens: int) -> bool:
    """Whether the others' tokens were a busy share of the engine's work beside ``own_tokens``."""
    return others > 0 and others >= BUSY_SHARE * (others + own_tokens)


def meanwhile(loads: tuple[TenantLoad, ...], engine: str) -> str:
    """What the engine computed for the other requests during a window, for a summary."""
    if not others_tokens(loads):
        return f"{engine} computed nothing for other requests meanwhile"
    return f"{engine} computed {others_tokens(loads):,} tokens for other requests meanwhile: {loads_text(loads)}"


def seconds_of(ns: int) -> float:
    return max(0, ns) / 1e9
