"""Ports picked now for a server that binds them later (``tessera up``'s gateway and controller metrics
endpoints, the tests' and benches' gateways) lie below the kernel's ephemeral range: while Ray starts, its
processes' outgoing connections take source ports from that range, and one took a bench gateway's port before
the gateway bound it (EADDRINUSE, "the gateway exited with code 3", 2026-12-05)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tessera.engine import ports
from tessera.local import platform
from tests.support.machine import free_port

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not EPHEMERAL.exists(), reason="no ephemeral port range to stay out of on this system")
@pytest.mark.parametrize("pick", [ports.free_port, free_port], ids=["tessera up and the engines", "tests and benches"])
def test_a_port_bound_later_is_picked_below_the_ephemeral_range(pick: Callable[[], int]) -> None:
    low = int(EPHEMERAL.read_text().split()[0])
    picked = {pick() for _ in range(50)}
    assert all(port < low for port in picked), sorted(p for p in picked if p >= low)
    assert len(picked) > 1  # random within the range: two pickers at once rarely meet


def test_tessera_up_picks_its_later_bound_ports_with_the_engines_picker() -> None:
    assert platform.free_port is ports.free_port
