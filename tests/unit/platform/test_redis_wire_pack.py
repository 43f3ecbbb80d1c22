"""The RESP packer (tessera/resp.py; the gateway's lean connection and the Sentinel resolver write with it):
hiredis's C packer writes the very bytes the Python packer writes, for every argument type a command carries,
and an argument hiredis refuses (a bool) falls back to the Python packer instead of failing the request."""

from __future__ import annotations

import random

import pytest

from tessera.resp import Command, pack_commands, pack_commands_in_python


def random_argument(rng: random.Random) -> str | bytes | int | float:
    kind = rng.randrange(6)
    if kind == 0:
        return "".join(rng.choice("abcé:{}-_ \r\n😀") for _ in range(rng.randrange(0, 40)))
    if kind == 1:
        return bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40)))
    if kind == 2:
        return rng.randrange(-(1 << 70), 1 << 70)
    if kind == 3:
        return rng.choice([0.1 + 0.2, 1e-05, 1e20, 3.0, -2.5e-7, rng.uniform(-1e6, 1e6)])
    if kind == 4:
        return rng.randrange(0, 100)
    return ""


def test_hiredis_and_python_pack_the_same_bytes() -> None:
    rng = random.Random(7)
    for _ in range(500):
        commands: list[Command] = [("EVALSHA", *(random_argument(rng) for _ in range(rng.randrange(0, 30))))
                                   for _ in range(rng.randrange(1, 4))]
        assert pack_commands(commands) == pack_commands_in_python(commands)


@pytest.mark.parametrize("odd", [True, False])
def test_an_argument_hiredis_refuses_is_packed_in_python(odd: bool) -> None:
    commands: list[Command] = [("SET", "k", odd), ("GET", "k")]
    assert pack_commands(commands) == pack_commands_in_python(commands)
    assert pack_commands(commands).startswith(b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n%s\r\n"
                                              % (len(str(odd)), str(odd).encode()))
