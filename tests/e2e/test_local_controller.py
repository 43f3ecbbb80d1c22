"""The local platform is the whole platform: the KV-eviction controller runs beside the engines and the
gateway, keeps its ledger from the engine's KV events and attributes cached blocks to tenants."""

from __future__ import annotations

import asyncio
import re
import time

import httpx

from tessera.local.platform import LocalPlatform


def metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if line.split("{")[0].split(" ")[0] == name and all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_controller_watches_the_engine_and_attributes_blocks(platform_stack: LocalPlatform) -> None:
    assert platform_stack.kvcontrol is not None and platform_stack.kvcontrol.poll() is None
    (record,) = platform_stack.engines()
    key = asyncio.run(platform_stack.create_tenant("e2e-ledger"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the controller's first poll of a just-registered engine
        text = httpx.get(platform_stack.kvcontrol_metrics_url, timeout=5).text
        if metric(text, "tessera_kv_blocks_total", engine=record.engine_id):
            break
        time.sleep(0.5)
    assert metric(text, "tessera_kvcontrol_engines") == 1.0
    # vLLM keeps one block of the cache as its null block; the controller counts the usable ones.
    assert metric(text, "tessera_kv_blocks_total", engine=record.engine_id) in (record.num_gpu_blocks,
                                                                               record.num_gpu_blocks - 1)
    # 64 distinct words: well over two 32-token blocks, cached under this tenant's salt.
    prompt = " ".join(f"word{i}" for i in range(64))
    response = httpx.post(f"{platform_stack.base_url}/v1/completions", timeout=60,
                          headers={"authorization": f"Bearer {key}"},
                          json={"model": platform_stack.model, "prompt": prompt, "max_tokens": 2})
    assert response.status_code == 200
    deadline = time.monotonic() + 30
    blocks = None
    while time.monotonic() < deadline and not blocks:
        text = httpx.get(platform_stack.kvcontrol_metrics_url, timeout=5).text
        blocks = metric(text, "tessera_kv_tenant_blocks", engine=record.engine_id, tenant="e2e-ledger")
        time.sleep(0.5)
    assert blocks is not None and blocks >= 2
