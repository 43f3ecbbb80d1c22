"""The whole platform, started exactly as ``make run`` starts it (embedded Redis, Ray Serve engine, gateway
processes), once per test session."""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tessera.local.platform import LocalPlatform, LocalPlatformOptions
from tessera.redis_conn import connect
from tessera.registry import EngineRegistry
from tests.support.machine import free_port
from tests.support.platform_report import describe_platform

ADMIN_TOKEN = "e2e-admin-token"


@pytest.fixture(scope="session")
def platform_stack(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalPlatform]:
    state = tmp_path_factory.mktemp("platform")
    platform = LocalPlatform(LocalPlatformOptions(
        state_dir=state, model_dir=small_model_dir, gateway_port=free_port(), gateway_workers=2,
        admin_token=ADMIN_TOKEN, trace_dir=state / "traces",
        engine_overrides={"served_model_name": "tessera-small", "max_model_len": 1024},
    ))
    try:
        platform.start()
        yield platform
    finally:
        platform.stop()


@pytest.fixture(scope="session")
def engine_url(platform_stack: LocalPlatform) -> str:
    """The platform's one engine replica's own address, from the registry in Redis."""
    async def read() -> str:
        redis = connect(platform_stack.redis_url, timeout_s=5)
        try:
            (record,) = await EngineRegistry(redis).live_engines()
            return record.url
        finally:
            await redis.aclose()

    return asyncio.run(read())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None],
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used the platform reports what the platform was doing (tests/support/platform_report)."""
    report: pytest.TestReport = yield
    platform = getattr(item, "funcargs", {}).get("platform_stack")
    if report.failed and isinstance(platform, LocalPlatform):
        report.sections.append(("platform at failure", describe_platform(platform)))
    return report
