"""Billing a request whose gateway never finished it: pure decisions over a ticket and the engine's record.

Every admitted request leaves a *ticket* in Redis (admission.lua: its reservation, prompt size, budget key
and engine request id) in a set ordered by a settle-by time that the gateway's lease renewals push forward.
A request whose gateway finishes it closes its ticket (finish.lua). A ticket still open ``grace`` seconds
after its settle-by time belongs to a gateway that died (SIGKILL, OOM, lost node) or was cut off from Redis
for longer than a lease; the settler (gateway/settler.py) then bills it here:

- the engine replica's record of the request (engine/usage_record.py: prompt and generated tokens of each
  attempt, written when the request ended on the engine) gives the charge: ``SettleKind.ENGINE``, exact;
- no record (the engine died too, or its record expired before any settler ran): the whole reservation is
  charged, labelled ``SettleKind.RESERVATION`` in the tenant's usage (``charged_reservation``).

Either way the charge is capped at the reservation, and finish.lua decides atomically between this and a
late finish from the request's own gateway: whichever sets the lease's done marker first bills it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum


class SettleKind(StrEnum):
    """How finish.lua bills a lease (its ``kind`` argument)."""

    GATEWAY = "gateway"  # the request's own gateway, with the tokens it relayed
    ENGINE = "engine"  # the settler, from the engine's record
    RESERVATION = "reservation"  # the settler, without a record: the whole reservation
    VOID = "void"  # the admission's reply was lost and the client got an error: undo the reservation


def ticket_member(tenant: str, lease_id: str) -> str:
    """A ticket's name in the open set and the tickets hash (tenant names hold no ':')."""
    return f"{tenant}:{lease_id}"


@dataclass(frozen=True, slots=True)
class Ticket:
    """What admission.lua wrote for one admitted request."""

    tenant: str
    lease_id: str
    reserved_tokens: int
    prompt_tokens: int
    admitted_at: float  # Redis time, seconds
    budget_key: str
    engine_request_id: str  # "" when the caller gave none (then no engine record can be found)

    @property
    def member(self) -> str:
        return ticket_member(self.tenant, self.lease_id)


def parse_ticket(member: str, value: str) -> Ticket:
    """A ticket from its member (``tenant:lease_id``) and its value ("reserved prompt admitted_at budget_key
    engine_request_id"); ``ValueError`` when either is malformed."""
    tenant, sep, lease_id = member.partition(":")
    parts = value.split(" ", 4)
    if not sep or not tenant or not lease_id or len(parts) < 4:
        raise ValueError(f"malformed ticket {member!r}: {value!r}")
    return Ticket(tenant, lease_id, int(parts[0]), int(parts[1]), float(parts[2]), parts[3],
                  parts[4] if len(parts) == 5 else "")


@dataclass(frozen=True, slots=True)
class AttemptUsage:
    """One engine attempt of a request, as the engine recorded it: the prompt it was given (the request's
    prompt, plus the tokens of earlier attempts for a continuation) and the tokens it generated."""

    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True, slots=True)
class Charge:
    """What finish.lua is asked to bill (it caps the total at the reservation once more)."""

    kind: SettleKind
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def generated_tokens(prompt_tokens: int, attempts: Sequence[AttemptUsage]) -> int:
    """Tokens generated for a request of ``prompt_tokens`` over its attempts: a continuation's prompt carries
    the tokens generated before it (engine/protocol.py ``continuation``), so each attempt stands for
    ``its prompt - the request's prompt + its output``, and the longest chain is what was generated (a lost
    record of an earlier attempt is then covered by the later one)."""
    return max((max(0, a.prompt_tokens - prompt_tokens) + a.output_tokens for a in attempts), default=0)


def decide(ticket: Ticket, attempts: Sequence[AttemptUsage] | None) -> Charge:
    """The charge for an expired ticket. ``attempts``: the engine's record (None or empty: none found)."""
    budget_left = max(0, ticket.reserved_tokens - ticket.prompt_tokens)
    if not attempts:
        return Charge(SettleKind.RESERVATION, ticket.prompt_tokens, budget_left)
    return Charge(SettleKind.ENGINE, ticket.prompt_tokens,
                  min(budget_left, generated_tokens(ticket.prompt_tokens, attempts)))
