"""Fixtures: the mock server as a real subprocess (uvicorn + uvloop + httptools), started per config."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.support.mock_server import read_mock_stats, start_mock_server

MockFactory = Callable[..., str]


@pytest.fixture
def mock_server() -> Iterator[MockFactory]:
    """``mock_server(ttft_s=0.05, ...)`` starts a mock server with those CLI options; returns its URL."""
    processes: list[subprocess.Popen[str]] = []

    def start(**options: Any) -> str:
        process, url = start_mock_server(options)
        processes.append(process)
        return url

    yield start
    for process in processes:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def mock_stats() -> Callable[[str], dict[str, int]]:
    """``mock_stats(url)``: what the mock server counted (requests, valid traceparents, faults)."""
    return read_mock_stats
