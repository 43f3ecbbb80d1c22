"""`tessera up` keeps its Redis data under the state directory (issue #16): a tenant and its key created in
one run authenticate in the next, after a clean stop and after the server was SIGKILLed. No Ray, no engine:
only the platform's embedded Redis starts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tessera.local.platform import LocalPlatform, LocalPlatformOptions, PlatformStartError
from tessera.redis_conn import connect
from tessera.tenancy.store import TenantStore


async def _owner(redis_url: str, key: str) -> str | None:
    redis = connect(redis_url, timeout_s=5)
    try:
        return await TenantStore(redis).authenticate(key)
    finally:
        await redis.aclose()


def _what_the_server_kept(data_dir: Path) -> str:
    """The data directory's files and the servers' log, for a failure to say whether the write never reached
    the append-only file or the next server did not replay it."""
    files = sorted(f"{p.relative_to(data_dir)} {p.stat().st_size} B" for p in data_dir.rglob("*") if p.is_file())
    logs = "".join(p.read_text(errors="replace")[-3000:] for p in data_dir.glob("*.log"))
    return f"files: {files}\nlog:\n{logs}"


@pytest.mark.parametrize("how", ["stop", "kill"])
def test_a_tenant_key_survives_the_next_run(tmp_path: Path, how: str) -> None:
    first = LocalPlatform(LocalPlatformOptions(state_dir=tmp_path))
    first.start_redis()
    try:
        assert first.redis is not None and first.redis.data_dir == (tmp_path / "redis").resolve()
        key = asyncio.run(first.create_tenant("demo"))
    finally:
        if how == "kill":
            assert first.redis is not None
            first.redis.kill()
            first.redis = None
        first.stop()

    second = LocalPlatform(LocalPlatformOptions(state_dir=tmp_path))
    second.start_redis()
    try:
        assert asyncio.run(_owner(second.redis_url, key)) == "demo", _what_the_server_kept(tmp_path / "redis")
        # The next run's banner key is a new key of the same tenant; the old one keeps working beside it.
        assert asyncio.run(_owner(second.redis_url, asyncio.run(second.create_tenant("demo")))) == "demo"
        assert asyncio.run(_owner(second.redis_url, key)) == "demo"
    finally:
        second.stop()


def test_a_caller_with_its_own_redis_url_gets_no_embedded_server(tmp_path: Path) -> None:
    platform = LocalPlatform(LocalPlatformOptions(state_dir=tmp_path, redis_url="redis://127.0.0.1:1/0"))
    platform.start_redis()
    assert platform.redis is None and not (tmp_path / "redis").exists()
    assert (platform.run_dir / "redis_url").read_text() == "redis://127.0.0.1:1/0"


def test_a_second_run_on_the_same_state_directory_is_refused(tmp_path: Path) -> None:
    first = LocalPlatform(LocalPlatformOptions(state_dir=tmp_path))
    first.start_redis()
    try:
        second = LocalPlatform(LocalPlatformOptions(state_dir=tmp_path))
        with pytest.raises(PlatformStartError, match="another `tessera up` is running"):
            second.start_redis()
        assert second.redis is None, "no second server appends to the same AOF"
    finally:
        first.stop()
    third = LocalPlatform(LocalPlatformOptions(state_dir=tmp_path))
    third.start_redis()  # the lock went with the first run
    third.stop()
