"""Redis commands as they go on the wire (RESP arrays of bulk strings), for the two places that write them
themselves: the gateway's lean connection (redis_wire.py) and the Sentinel resolver (redis_sentinel.py)."""

from __future__ import annotations

import hiredis

Command = tuple[str | bytes | int | float, ...]


def pack_commands(commands: list[Command]) -> bytes:
    """By hiredis's packer, in C (the admission trip's two dozen arguments in ~7 against ~18 us), or by
    ``pack_commands_in_python``, byte for byte the same, where an argument is of a type hiredis refuses (a bool,
    written as Python's ``str`` writes it)."""
    try:
        # hiredis's stub types the argument as a 1-tuple; it takes a command of any length.
        return b"".join([hiredis.pack_command(command) for command in commands])  # type: ignore[arg-type]
    except TypeError:
        return pack_commands_in_python(commands)


def pack_commands_in_python(commands: list[Command]) -> bytes:
    """``pack_commands`` for any argument ``str`` can write."""
    parts: list[bytes] = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            data = arg if isinstance(arg, bytes) else str(arg).encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)
