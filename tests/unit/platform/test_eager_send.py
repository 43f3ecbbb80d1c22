"""send_now: an ASGI-style coroutine run on the spot from synchronous code, continued as a task only when it
suspends (the gateway's per-chunk relay writes to the client this way)."""

from __future__ import annotations

import asyncio

import pytest

from tessera.gateway.eager_send import send_now


async def test_a_coroutine_that_does_not_suspend_finishes_on_the_spot() -> None:
    done: list[str] = []

    async def send() -> None:
        done.append("written")

    assert send_now(send()) is None
    assert done == ["written"]  # before any await of the caller: nothing was scheduled


async def test_an_error_before_suspending_is_raised_to_the_caller() -> None:
    async def send() -> None:
        raise RuntimeError("Expected ASGI message 'http.response.body'")

    with pytest.raises(RuntimeError, match="Expected ASGI message"):
        send_now(send())


async def test_a_suspended_coroutine_continues_as_a_task_in_order() -> None:
    writable = asyncio.get_running_loop().create_future()
    steps: list[str] = []

    async def send() -> None:
        steps.append("waiting for the client")
        steps.append(f"drained: {await writable}")
        steps.append("written")

    rest = send_now(send())
    assert rest is not None and steps == ["waiting for the client"]
    await asyncio.sleep(0)
    assert not rest.done()
    writable.set_result("yes")
    await rest
    assert steps == ["waiting for the client", "drained: yes", "written"]


async def test_an_error_after_suspending_reaches_the_task() -> None:
    writable = asyncio.get_running_loop().create_future()

    async def send() -> None:
        await writable
        raise ConnectionResetError("client gone")

    rest = send_now(send())
    assert rest is not None
    writable.set_exception(OSError("reset"))
    with pytest.raises(OSError, match="reset"):
        await rest


async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    cleaned: list[bool] = []

    async def send() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append(True)

    rest = send_now(send())
    assert rest is not None
    await asyncio.sleep(0)
    rest.cancel()
    with pytest.raises(asyncio.CancelledError):
        await rest
    assert cleaned == [True]


async def test_several_suspensions_each_wait_for_their_own_future() -> None:
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    got: list[int] = []

    async def send() -> None:
        got.append(await first)
        got.append(await second)

    rest = send_now(send())
    assert rest is not None
    first.set_result(1)
    await asyncio.sleep(0.01)
    assert got == [1] and not rest.done()
    second.set_result(2)
    await rest
    assert got == [1, 2]
