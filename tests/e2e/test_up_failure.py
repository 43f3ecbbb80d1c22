"""``tessera up`` whose engine cannot start: exit 1 with the cause and its fix in a line, not Ray's traceback."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

TESSERA = str(Path(sys.executable).parent / "tessera")


def test_up_names_why_the_engine_could_not_start(tmp_path: Path, small_model_dir: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # A draft model that is not there, and a config that forbids running without it.
    engine = {"speculative": {"method": "eagle", "draftModel": "/nonexistent/draft", "strict": True}}
    run = subprocess.run([TESSERA, "up", "--port", str(port), "--state-dir", str(tmp_path), "--model",
                          str(small_model_dir), "--no-kvcontrol", "--engine-config", json.dumps(engine)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr
    (error,) = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert "the engine replicas could not start" in error and "/nonexistent/draft" in error
    assert "speculative.strict is true" in error and "speculative: null" in error
    assert "Traceback" not in run.stderr and "Deploying application" not in run.stderr
    assert "AttributeError" not in run.stderr + run.stdout
    assert "tessera doctor" in run.stderr
