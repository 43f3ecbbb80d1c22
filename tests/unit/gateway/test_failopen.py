"""The request path's one fail-open policy (gateway/failopen.py): last known answers or 503."""

from __future__ import annotations

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from tessera.gateway.errors import APIError
from tessera.gateway.failopen import FailOpen


async def _answer(value: object) -> object:
    return value


async def _down() -> object:
    raise RedisConnectionError("down")


async def test_fail_closed_answers_503_store_unavailable_even_for_what_it_read_before() -> None:
    policy = FailOpen(False)
    assert await policy.read("model", "m", _answer("served")) == "served"
    with pytest.raises(APIError) as info:
        await policy.read("model", "m", _down())
    assert (info.value.status, info.value.code) == (503, "store_unavailable")
    with pytest.raises(APIError):
        policy.admit_without_store(RedisConnectionError("down"))


async def test_fail_open_serves_the_last_known_answer_per_kind_and_key() -> None:
    policy = FailOpen(True)
    assert await policy.read("model", "m", _answer("first")) == "first"
    assert await policy.read("model", "m", _answer("second")) == "second"
    assert await policy.read("model", "m", _down()) == "second"
    with pytest.raises(APIError):  # never read: nothing to serve
        await policy.read("model", "other", _down())
    with pytest.raises(APIError):  # another kind, same key
        await policy.read("route", "m", _down())
    policy.admit_without_store(RedisConnectionError("down"))  # returns: admitted without Redis


async def test_a_missing_answer_is_not_remembered() -> None:
    policy = FailOpen(True)
    assert await policy.read("model", "m", _answer(None)) is None
    with pytest.raises(APIError):
        await policy.read("model", "m", _down())


async def test_optional_reads_go_on_with_the_default_in_both_modes() -> None:
    for enabled in (False, True):
        assert await FailOpen(enabled).optional(_down(), "default") == "default"
        assert await FailOpen(enabled).optional(_answer("x"), "default") == "x"
