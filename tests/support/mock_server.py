"""tessera-loadgen's mock server (uvicorn + uvloop + httptools) as a real subprocess."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import urllib.request
from typing import Any


def start_mock_server(options: dict[str, Any]) -> tuple[subprocess.Popen[str], str]:
    """Starts ``tessera-loadgen mock-server`` with ``options`` as CLI flags; (the process, its URL)."""
    args = [sys.executable, "-m", "tessera_loadgen.cli", "mock-server", "--port", "0"]
    for name, value in options.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ)
    if not selector.select(timeout=30):
        process.kill()
        raise RuntimeError("mock server did not start within 30 s")
    line = process.stdout.readline().strip()
    if "listening on" not in line:
        process.kill()
        raise RuntimeError(f"unexpected mock server output: {line!r}")
    return process, line.rsplit(" ", 1)[1]


def read_mock_stats(url: str) -> dict[str, int]:
    """What the mock server at ``url`` counted (requests, valid traceparents, faults)."""
    with urllib.request.urlopen(f"{url}/mock/stats", timeout=5) as response:
        data: dict[str, int] = json.loads(response.read())
        return data
