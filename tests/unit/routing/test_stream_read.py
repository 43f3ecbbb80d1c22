"""``stream_entries``: an XREAD reply, in either protocol's shape, as (id, fields) pairs."""

from __future__ import annotations

import pytest

from tessera.routing.stream_read import stream_entries


def test_a_resp2_reply_becomes_its_entries_in_order() -> None:
    reply = [[b"s", [[b"1-0", [b"e", b"a", b"n", b"1"]], [b"2-0", [b"e", b"b", b"n", b"2"]]]]]
    assert stream_entries(reply) == [(b"1-0", {b"e": b"a", b"n": b"1"}), (b"2-0", {b"e": b"b", b"n": b"2"})]


def test_a_resp3_reply_becomes_the_same_entries() -> None:
    assert stream_entries({b"s": [[b"1-0", [b"e", b"a"]]]}) == [(b"1-0", {b"e": b"a"})]


@pytest.mark.parametrize("reply", [None, [], {}])
def test_a_block_that_ran_out_is_no_entries(reply: object) -> None:
    assert stream_entries(reply) == []


def test_an_entry_with_an_odd_field_list_is_refused() -> None:
    with pytest.raises(ValueError):
        stream_entries([[b"s", [[b"1-0", [b"e"]]]]])
