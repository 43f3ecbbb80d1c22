"""Fixtures: the mock server as a real subprocess (uvicorn + uvloop + httptools), started per config."""

from __future__ import annotations

import json
import selectors
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

MockFactory = Callable[..., str]


def _start(options: dict[str, Any]) -> tuple[subprocess.Popen[str], str]:
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


@pytest.fixture
def mock_server() -> Iterator[MockFactory]:
    """``mock_server(ttft_s=0.05, ...)`` starts a mock server with those CLI options; returns its URL."""
    processes: list[subprocess.Popen[str]] = []

    def start(**options: Any) -> str:
        process, url = _start(options)
        processes.append(process)
        return url

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


def _read_stats(url: str) -> dict[str, int]:
    with urllib.request.urlopen(f"{url}/mock/stats", timeout=5) as response:
        data: dict[str, int] = json.loads(response.read())
        return data


@pytest.fixture
def mock_stats() -> Callable[[str], dict[str, int]]:
    """``mock_stats(url)``: what the mock server counted (requests, valid traceparents, faults)."""
    return _read_stats
