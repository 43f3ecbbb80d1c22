"""Admission's one Redis round trip on the request path, as a command builder and its reply parser.

One write carries, in order: the admission script (``EVALSHA``, see admission.py), ``EXISTS`` of the
tenant's demotion flags (demotion.py: one per controller shard), and optionally one more command that
rides along (the gateway sends the route's prefix lookup here when it routes on the Redis index, so an
admitted request needs no round trip of its own to route; with its local index nothing rides along). Over
the gateway's lean connection (``redis_wire.RedisWire``) that is the one Redis round trip before the engine
call.

A Redis that lost its scripts (restarted, flushed) answers NOSCRIPT: that script did not run, so the
parser admits once more with ``Admission.admit``, which loads the script (admitted exactly once); the
riding command's own NOSCRIPT comes back as its reply, for its owner to handle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.exceptions import NoScriptError

from tessera.redis_wire import Command
from tessera.tenancy.admission import Admission, AdmitCall, Lease, Rejection
from tessera.tenancy.demotion import demoted_keys
from tessera.tenancy.policy import TenantPolicy


@dataclass(frozen=True, slots=True)
class AdmissionTrip:
    """One prepared round trip: the admission it asks for and the commands to send."""

    tenant: str
    policy: TenantPolicy
    call: AdmitCall
    commands: list[Command]
    prompt_tokens: int = 0
    engine_request_id: str = ""

    @property
    def carries_extra(self) -> bool:
        return len(self.commands) > 2


@dataclass(frozen=True, slots=True)
class TripReply:
    """What the round trip brought back: the verdict, whether the KV-eviction controller has demoted the
    tenant, and the riding command's reply (None: nothing rode along; an exception object: its error)."""

    decision: Lease | Rejection
    demoted: bool
    extra: Any = None


def build_trip(admission: Admission, tenant: str, policy: TenantPolicy, reserve_tokens: int,
               extra: Command | None = None, prompt_tokens: int = 0, engine_request_id: str = "") -> AdmissionTrip:
    """``prompt_tokens`` and ``engine_request_id`` go on the request's ticket (admission.py ``prepare``)."""
    call = admission.prepare(tenant, policy, reserve_tokens, prompt_tokens, engine_request_id)
    commands: list[Command] = [("EVALSHA", admission.admit_sha, len(call.keys), *call.keys, *call.args),
                               ("EXISTS", *demoted_keys(tenant, admission.demotion_shards))]
    if extra is not None:
        commands.append(extra)
    return AdmissionTrip(tenant, policy, call, commands, prompt_tokens, engine_request_id)


async def parse_trip(admission: Admission, trip: AdmissionTrip, replies: list[Any]) -> TripReply:
    """The replies of ``trip.commands`` in order (errors as exception objects, as ``RedisWire.execute`` and
    ``pipeline.execute(raise_on_error=False)`` return them). Raises the admission script's error, except
    NOSCRIPT, which admits once with the standalone call."""
    verdict, demoted = replies[0], replies[1]
    if isinstance(verdict, NoScriptError):
        decision = await admission.admit(trip.tenant, trip.policy, trip.call.lease.reserved_tokens,
                                         trip.prompt_tokens, trip.engine_request_id)
    elif isinstance(verdict, Exception):
        raise verdict
    else:
        decision = trip.call.outcome(verdict)
    return TripReply(decision, not isinstance(demoted, Exception) and bool(demoted),
                     replies[2] if trip.carries_extra else None)
