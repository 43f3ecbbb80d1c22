"""Where vLLM's engine children log their errors (engine/root_cause.py): engines started in parallel threads
configure the capture once, and the config file is never seen half-written."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tessera.engine import root_cause


def test_engines_starting_in_parallel_threads_write_the_logging_config_once(monkeypatch: pytest.MonkeyPatch,
                                                                              tmp_path: Path) -> None:
    monkeypatch.delenv("VLLM_LOGGING_CONFIG_PATH", raising=False)
    monkeypatch.setattr(root_cause.tempfile, "gettempdir", lambda: str(tmp_path))
    replaced: list[str] = []
    real_replace = os.replace

    def counting_replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        replaced.append(str(dst))
        real_replace(src, dst)

    monkeypatch.setattr(root_cause.os, "replace", counting_replace)
    start = threading.Barrier(8)
    results: list[Path | None] = []

    def configure() -> None:
        start.wait()
        results.append(root_cause._configure_capture())

    threads = [threading.Thread(target=configure) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    config_path = Path(os.environ["VLLM_LOGGING_CONFIG_PATH"])
    assert len(replaced) == 1 and replaced[0] == str(config_path)
    assert len(set(results)) == 1 and results[0] is not None
    config = json.loads(config_path.read_text())  # whole, valid JSON
    assert "tessera_errors" in config["handlers"]
    assert not list(tmp_path.glob("*.tmp"))  # nothing staged left behind


def test_an_operators_own_vllm_logging_config_is_left_alone(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    own = tmp_path / "mine.json"
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(own))
    assert root_cause._configure_capture() is None
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(own) and not own.exists()
