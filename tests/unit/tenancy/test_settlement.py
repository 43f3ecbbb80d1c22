"""The settler's pure decisions (tenancy/settlement.py): bill from the engine's record, or charge the whole
reservation, always within the reservation; and the ticket's format. (Whether a lease was
billed already is finish.lua's decision, on a real Redis: tests/integration/tenancy/test_settlement.py.)"""

from __future__ import annotations

import pytest

from tessera.tenancy.settlement import (
    AttemptUsage,
    Charge,
    SettleKind,
    Ticket,
    decide,
    generated_tokens,
    parse_ticket,
    ticket_member,
)

# 20 prompt tokens, max_tokens 100: a reservation of 120.
TICKET = Ticket("acme", "L1", 120, 20, 1_700_000_000.5, "tessera:rl:acme:budget:2026-12", "acme/cmpl-1")


def test_the_engine_record_is_billed_exactly() -> None:
    assert decide(TICKET, [AttemptUsage(20, 37)]) == Charge(SettleKind.ENGINE, 20, 37)


def test_without_a_record_the_whole_reservation_is_charged() -> None:
    assert decide(TICKET, None) == Charge(SettleKind.RESERVATION, 20, 100)
    assert decide(TICKET, []) == Charge(SettleKind.RESERVATION, 20, 100)
    assert decide(TICKET, None).total_tokens == TICKET.reserved_tokens


def test_a_record_beyond_the_reservation_is_capped() -> None:
    # A failover that restarted generation from scratch: the engines together report more than was admitted.
    assert decide(TICKET, [AttemptUsage(20, 100), AttemptUsage(20, 60)]) == Charge(SettleKind.ENGINE, 20, 100)
    assert decide(TICKET, [AttemptUsage(20, 500)]).total_tokens == 120


def test_a_continuation_counts_the_tokens_its_prompt_carries() -> None:
    # Attempt 0 generated 30 and was aborted; attempt 1 got the prompt + those 30 and generated 25 more.
    attempts = [AttemptUsage(20, 30), AttemptUsage(50, 25)]
    assert generated_tokens(20, attempts) == 55
    # The first engine's record lost (it died before writing it): the continuation still shows all 55.
    assert generated_tokens(20, attempts[1:]) == 55
    assert decide(TICKET, attempts) == Charge(SettleKind.ENGINE, 20, 55)


def test_an_attempt_that_generated_nothing_bills_the_prompt() -> None:
    assert decide(TICKET, [AttemptUsage(20, 0)]) == Charge(SettleKind.ENGINE, 20, 0)


def test_a_ticket_round_trips_through_its_redis_form() -> None:
    value = f"120 20 {TICKET.admitted_at:.3f} {TICKET.budget_key} {TICKET.engine_request_id}"
    assert parse_ticket(ticket_member("acme", "L1"), value) == TICKET
    # Admitted by a caller that named no engine request: an empty last field.
    assert parse_ticket("acme:L1", "120 20 5.0 b ").engine_request_id == ""


@pytest.mark.parametrize("member, value", [("acme", "120 20 5.0 b r"), ("acme:L1", "120 20"),
                                           ("acme:L1", "x 20 5.0 b r"), (":L1", "1 1 1 b r")])
def test_a_malformed_ticket_is_a_value_error(member: str, value: str) -> None:
    with pytest.raises(ValueError):
        parse_ticket(member, value)

