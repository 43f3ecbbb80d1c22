"""What tests and benchmarks take from the machine they share: free TCP ports and CPU sets.

The one copy for ``tests/`` and ``bench/`` (``bench/_support.py`` re-exports it). ``tessera.engine.ports``
is the product's own port picker (ranges, the ephemeral range) and is tested as such; a test that only needs
somewhere to listen uses ``free_port`` here, which picks with it below the ephemeral range.
"""

from __future__ import annotations

import os

from tessera.engine import ports


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listened on a moment ago, below the kernel's ephemeral range: a server
    started on it later (a gateway, after Ray came up) cannot meanwhile lose it to an outgoing connection's
    source port (``tessera.engine.ports.free_port``)."""
    return ports.free_port("127.0.0.1")


def pinned(command: list[str], cpus: str | None) -> list[str]:
    """``command`` run on the CPU set ``cpus`` (``taskset -c`` syntax, e.g. ``"0"`` or ``"1,2"``); None:
    unpinned."""
    return ["taskset", "-c", cpus, *command] if cpus else command


def pin_this_process(cpus: str | None) -> None:
    """Binds the calling process to ``cpus`` (``taskset -c`` list syntax without ranges); None: leaves it."""
    if cpus:
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def split_cores() -> tuple[str | None, str | None]:
    """(engine cores, platform cores) for runs that compare paths through one engine: the engine on the first
    core and everything else (gateway, client, Redis) on the rest. Unpinned on a 2-core machine, vLLM's busy
    engine-core loop and worker share the cores with the gateway and the client, which then wait for a CPU
    for up to a whole generation (measured: a 687-byte socket write to the engine held for ~120 ms).
    (None, None) on a single core."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None, None
    return str(cores[0]), ",".join(str(c) for c in cores[1:])
