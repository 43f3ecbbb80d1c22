"""With Ray token auth on (the production scenario), the probes still work: checked against Ray 2.60's own
token middleware and public paths (tests/support/ray_auth_server.py), not against a description of them.
Ray's head dashboard and dashboard agent serve their health paths without a token, so the head's and the
workers' readiness and liveness probes need none; the workers' startup probe reads the head's Serve API,
which needs one, and presents KubeRay's RAY_AUTH_TOKEN as `Authorization: Bearer`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.support.chart import CHART_DIR, JSON, REPO, find, load_values, render

TOKEN = "tessera-test-token-0123456789abcdef"
PRODUCTION = CHART_DIR / "ci" / "production-external-redis-values.yaml"


@pytest.fixture(scope="module")
def ray_ports() -> Iterator[dict[int, int]]:
    """Ray's ports as the probes name them -> the stand-in's ports."""
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN}
    server = subprocess.Popen([sys.executable, str(REPO / "tests" / "support" / "ray_auth_server.py")], env=env,
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert server.stdout is not None
    agent, head = (int(p) for p in server.stdout.readline().split())
    yield {52365: agent, 8265: head}
    server.kill()
    server.wait()


def _containers() -> dict[str, JSON]:
    cluster = find(render(load_values(PRODUCTION)), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["authOptions"]["mode"] == "token"
    return {"head": cluster["headGroupSpec"]["template"]["spec"]["containers"][0],
            "worker": cluster["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]}


def test_readiness_and_liveness_probes_need_no_token(ray_ports: dict[int, int]) -> None:
    for where, container in _containers().items():
        for probe in ("readinessProbe", "livenessProbe"):
            urls = re.findall(r"http://localhost:(\d+)(/\S+)", " ".join(container[probe]["exec"]["command"]))
            assert urls, (where, probe)
            for port, path in urls:
                with urllib.request.urlopen(f"http://127.0.0.1:{ray_ports[int(port)]}{path}", timeout=5) as answer:
                    assert answer.read() == b"success", (where, probe, path)


def test_the_startup_probe_presents_the_token_the_serve_api_needs(ray_ports: dict[int, int]) -> None:
    command = _containers()["worker"]["startupProbe"]["exec"]["command"]
    assert command[3:] == ["http://localhost:52365", "8265"]
    with pytest.raises(urllib.error.HTTPError, match="401"):
        urllib.request.urlopen(f"http://127.0.0.1:{ray_ports[8265]}/api/serve/applications/", timeout=5)

    def probe(token: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "RAY_AUTH_TOKEN": token, "FQ_RAY_IP": "127.0.0.1", "TESSERA_ADVERTISE_HOST": "10.1.2.3"}
        argv = [sys.executable, "-c", command[2], f"http://127.0.0.1:{ray_ports[52365]}", str(ray_ports[8265])]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30, check=False)

    assert probe(TOKEN).returncode == 0
    wrong = probe("not-the-token")
    assert wrong.returncode == 1 and "403" in wrong.stderr
