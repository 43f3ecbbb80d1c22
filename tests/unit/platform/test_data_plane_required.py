"""No data-plane key, no service: a replica, a simulated fleet, a gateway and a KV controller each refuse to
start without one, before they take a port or call anything (a replica must never run open)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.data_plane_auth import DataPlaneKeyError
from tessera.engine.config import EngineConfig
from tessera.engine.host import EngineHost
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.fleet import SimFleet
from tessera.gateway.app import Gateway
from tessera.settings import TesseraSettings
from tessera_operators.kvcontrol.controller import KVController
from tessera_operators.kvcontrol.settings import KVControlSettings


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TESSERA_DATA_PLANE_KEY_FILE", raising=False)


def test_an_engine_replica_does_not_start(no_key: None) -> None:
    with pytest.raises(DataPlaneKeyError, match="TESSERA_DATA_PLANE_KEY_FILE is not set: an engine replica"):
        EngineHost(EngineConfig(model="/m"), redis_url=None)


def test_a_replica_with_a_short_key_does_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    short = tmp_path / "key"
    short.write_text("0123456789")
    monkeypatch.setenv("TESSERA_DATA_PLANE_KEY_FILE", str(short))
    with pytest.raises(DataPlaneKeyError, match="shorter than 32 characters"):
        EngineHost(EngineConfig(model="/m"), redis_url=None)


def test_a_simulated_fleet_does_not_start(no_key: None) -> None:
    with pytest.raises(DataPlaneKeyError, match="a simulated replica"):
        SimFleet(SimEngineConfig(), 1, None)


def test_a_gateway_does_not_start(no_key: None) -> None:
    with pytest.raises(DataPlaneKeyError, match="a gateway"):
        Gateway(TesseraSettings(redis_url="redis://127.0.0.1:1/0", state_dir=Path("/nonexistent"),
                                trace_exporter="none"))


def test_a_kv_controller_does_not_start(no_key: None) -> None:
    with pytest.raises(DataPlaneKeyError, match="the KV controller"):
        KVController(KVControlSettings(redis_url="redis://127.0.0.1:1/0"))
