"""vLLM's KV-event publisher binds the replica's own address only: the endpoint Tessera hands it is one vLLM
binds (it connects to an endpoint without "*" or "::"), and libzmq binds it on that address alone."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq

from tessera.engine.ports import free_port, kv_events_bind_endpoint


@pytest.mark.parametrize(("host", "endpoint"), [
    ("127.0.0.1", "tcp://[::ffff:127.0.0.1]:5557"),
    ("10.1.2.3", "tcp://[::ffff:10.1.2.3]:5557"),
    ("localhost", "tcp://[::ffff:127.0.0.1]:5557"),
    ("0.0.0.0", "tcp://*:5557"),
    ("fd00::1", "tcp://*:5557"),
])
def test_the_endpoint_is_one_vllm_binds(host: str, endpoint: str) -> None:
    assert kv_events_bind_endpoint(host, 5557) == endpoint
    # vLLM's rule (ZmqEventPublisher._is_bind_endpoint; importing vLLM here would take most of a minute): the
    # real publisher's bind is read from the kernel in tests/integration/platform/test_engine_data_plane.py.
    assert "*" in endpoint or "::" in endpoint


def test_libzmq_binds_the_ipv4_address_alone() -> None:
    port = free_port("127.0.0.1")
    context = zmq.Context()
    publisher = context.socket(zmq.PUB)
    try:
        publisher.bind(kv_events_bind_endpoint("127.0.0.1", port))
        listening = [row.split()[1] for row in Path("/proc/net/tcp").read_text().splitlines()[1:]
                     if row.split()[3] == "0A" and int(row.split()[1].split(":")[1], 16) == port]
        assert listening == [f"0100007F:{port:04X}"]  # 127.0.0.1, not 0.0.0.0
    finally:
        publisher.close(linger=0)
        context.term()
