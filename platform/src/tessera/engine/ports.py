"""Ports an engine replica serves on: held from the moment they are picked, and picked from ranges that a
NetworkPolicy can open to one peer each."""

from __future__ import annotations

import ipaddress
import random
import socket
from pathlib import Path


def reserve_port(host: str, port_range: str | None = None) -> socket.socket:
    """A TCP socket bound to ``host`` on a free port, inside ``port_range`` ("start-end") when given.

    The caller keeps the socket until it serves on it: a port that is only probed and released can be taken
    by anything else in the ~20 s an engine takes to start (another engine, or the ephemeral source port of
    any outgoing connection), and the replica would then die on EADDRINUSE.

    NOTE: the Helm chart passes disjoint ranges for the HTTP and the KV-event ports
    (TESSERA_ENGINE_PORT_RANGE, TESSERA_KV_EVENTS_PORT_RANGE) so its NetworkPolicy can open each range
    to a different peer: HTTP only to gateways, KV events only to the controller.
    """
    candidates: list[int] = [0]
    if port_range:
        start, _, end = port_range.partition("-")
        first, last = int(start), int(end)
        if not 0 < first <= last < 65536:
            raise ValueError(f"port range {port_range!r} is invalid: use 'start-end' within 1-65535")
        candidates = random.sample(range(first, last + 1), min(64, last - first + 1))
    for port in candidates:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            # Listening is what makes the hold exclusive: two bound, non-listening SO_REUSEADDR sockets may
            # share a port. Connections that arrive early wait in the backlog until the server starts.
            sock.listen(1024)
        except OSError:
            sock.close()
            continue
        return sock
    if port_range is None:
        raise OSError(f"no free port on {host}")
    raise OSError(f"port {candidates[0]} is in use" if len(candidates) == 1 else f"no free port in {port_range}")


def free_port(host: str = "127.0.0.1", port_range: str | None = None) -> int:
    """A port that was free a moment ago; for a port someone else binds later (use reserve_port otherwise).
    From ``port_range``, else from just below the kernel's ephemeral range (``below_ephemeral_range``): until
    its server binds it, a port picked there cannot become an outgoing connection's source port (a bench's
    gateway lost its port so to a connection of Ray's while Ray started, 2026-12-05)."""
    port_range = port_range or below_ephemeral_range()
    # A port from a range must be free on every interface: whoever takes it may bind 0.0.0.0.
    with reserve_port("0.0.0.0" if port_range else host, port_range) as sock:
        return int(sock.getsockname()[1])


def below_ephemeral_range(width: int = 10000) -> str | None:
    """The ``width`` ports just below the kernel's ephemeral range, as "start-end" (None where unknown).

    vLLM binds the KV-event port itself, after start-up, so that port cannot be held for it. Picked from
    outside the ephemeral range, it cannot be taken meanwhile by an outgoing connection's source port.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return f"{low - width}-{low - 1}" if low - width >= 1024 else None


def kv_events_bind_endpoint(host: str, port: int) -> str:
    """The ZMQ endpoint on which vLLM's KV-event publisher binds ``host``:``port`` and no other interface.

    NOTE: vLLM binds an endpoint only when it contains "*" or "::" and connects to any other (its
    ``ZmqEventPublisher._is_bind_endpoint``): "tcp://10.0.0.5:5557" would make the publisher connect to a port
    nobody listens on. Written IPv4-mapped, "tcp://[::ffff:10.0.0.5]:5557" contains "::", and libzmq (IPv6 off,
    as vLLM leaves it) binds it as the plain IPv4 address; tests/integration/platform/test_engine_data_plane.py
    reads the listening socket. "0.0.0.0" means every interface ("*"); so does an IPv6 address, which libzmq
    binds only with IPv6 on (docs/security.md names it).
    """
    if host in ("0.0.0.0", "*"):
        return f"tcp://*:{port}"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    if address.version == 6:
        return f"tcp://*:{port}"
    return f"tcp://[::ffff:{address}]:{port}"
