"""Timed requests from a separate process, for the limits the issue states in milliseconds and seconds.

A test that hosts a vLLM engine in its own process shares the GIL with it, so latencies measured by the
test's own event loop include the engine's stalls. ``run_probe`` measures from a fresh interpreter that
does nothing else: one request at a time, recording wall-clock start, latency, status and error code.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

_SCRIPT = r"""
import json, sys, time
import httpx
spec = json.loads(sys.argv[1])
deadline = time.time() + spec["duration_s"]
out = []
with httpx.Client(timeout=spec["timeout_s"]) as client:
    i = 0
    while time.time() < deadline and (spec["count"] is None or i < spec["count"]):
        url = spec["urls"][i % len(spec["urls"])]
        started = time.time()
        t0 = time.perf_counter()
        try:
            r = client.request(spec["method"], url, json=spec["body"], headers=spec["headers"])
            status, text = r.status_code, r.text
        except httpx.HTTPError as exc:
            status, text = 0, repr(exc)
        latency = time.perf_counter() - t0
        code = None
        try:
            code = json.loads(text).get("error", {}).get("code")
        except Exception:
            pass
        out.append({"url": url, "started": started, "latency_s": latency, "status": status, "code": code})
        i += 1
        time.sleep(spec["interval_s"])
print(json.dumps(out))
"""


@dataclass(frozen=True)
class ProbeResult:
    url: str
    started: float  # wall clock (time.time()), comparable across processes
    latency_s: float
    status: int  # 0: no HTTP answer
    code: str | None


def start_probe(urls: list[str], headers: dict[str, str], body: dict[str, Any] | None = None, *,
                method: str = "POST", duration_s: float = 5.0, interval_s: float = 0.05, count: int | None = None,
                timeout_s: float = 10.0) -> subprocess.Popen[str]:
    spec = {"urls": urls, "headers": headers, "body": body, "method": method, "duration_s": duration_s,
            "interval_s": interval_s, "count": count, "timeout_s": timeout_s}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, json.dumps(spec)], stdout=subprocess.PIPE, text=True)


def probe_results(process: subprocess.Popen[str], timeout_s: float = 120.0) -> list[ProbeResult]:
    stdout, _ = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, f"probe failed with {process.returncode}"
    return [ProbeResult(**row) for row in json.loads(stdout)]


def run_probe(urls: list[str], headers: dict[str, str], body: dict[str, Any] | None = None,
              **options: Any) -> list[ProbeResult]:
    return probe_results(start_probe(urls, headers, body, **options))
