"""CPU of each part of a stack over a phase: psutil ``cpu_times`` deltas of every process in the stack's trees.

A stack names its root processes and the part each tree belongs to; ``classify`` (pure) then names the part
of every descendant from its name and command line, so one walk of the ``tessera up`` tree separates the
engine replica (and vLLM's engine-core child under it) from Ray's own processes, the gateway, Redis and the
KV-eviction controller. A sampler thread re-walks the trees every ``SAMPLE_S`` so processes that start or end
within a phase (Ray's idle workers, uvicorn workers) are counted for the part of the phase they lived.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import psutil

SAMPLE_S = 1.0

# Parts, in report order. A stack only has some of them.
PARTS = ("engine", "ray", "gateway", "redis", "controller", "up", "router", "proxy")

# Ray's own processes, by the name or command-line fragments Ray gives them.
_RAY_MARKERS = ("raylet", "gcs_server", "dashboard", "log_monitor", "monitor.py", "ray::", "default_worker.py",
                "runtime_env/agent", "ray_client_server", "ray/_private", "ray/autoscaler")


def classify(name: str, cmdline: str, inherited: str) -> str:
    """The part a process belongs to, from its name, its command line and its parent's part.

    The engine replica actor (Ray titles it ``ray::ServeReplica:tessera-engines:...``) and all its children
    (vLLM's engine core) are the engine; any other Ray process is Ray's; the gateway, Redis and the
    controller by their commands; anything else inherits its parent's part (uvicorn's worker processes,
    vLLM's multiprocessing children).
    """
    text = f"{name} {cmdline}"
    if inherited == "engine" or "ServeReplica:tessera-engines" in text:
        return "engine"
    if "tessera-kvcontrol" in text:
        return "controller"
    if " gateway " in f" {cmdline} " and "tessera" in cmdline:
        return "gateway"
    if inherited == "gateway":
        return "gateway"
    if "valkey" in text or "redis-server" in text:
        return "redis"
    if any(marker in text for marker in _RAY_MARKERS):
        return "ray"
    return inherited


@dataclass(frozen=True, slots=True)
class Seen:
    part: str
    cpu_s: float
    name: str = ""  # the process's name (Ray and vLLM title theirs: raylet, VLLM::EngineCore, ...)


def _cpu_s(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return float(times.user + times.system)


def walk(roots: dict[int, str]) -> dict[int, Seen]:
    """Every live process of the trees under ``roots`` (pid -> part of that tree), with its part and CPU."""
    seen: dict[int, Seen] = {}

    def visit(proc: psutil.Process, inherited: str) -> None:
        try:
            with proc.oneshot():
                part = classify(proc.name(), " ".join(proc.cmdline()), inherited)
                seen[proc.pid] = Seen(part, _cpu_s(proc), proc.name())
            children = proc.children()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            return
        for child in children:
            if child.pid not in seen:
                visit(child, part)

    for pid, part in roots.items():
        try:
            visit(psutil.Process(pid), part)
        except psutil.NoSuchProcess:
            continue
    return seen


class CpuMeter:
    """CPU seconds per part between ``start()`` and ``stop()``. A process alive at the start counts from its
    CPU then; one that starts later counts from zero; one that ends counts up to its last sample."""

    def __init__(self, roots: dict[int, str]) -> None:
        self.roots = roots
        self._first: dict[int, Seen] = {}
        self._last: dict[int, Seen] = {}
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        for pid, seen in walk(self.roots).items():
            self._first.setdefault(pid, Seen(seen.part, 0.0, seen.name))
            self._last[pid] = seen

    def start(self) -> CpuMeter:
        self._first = walk(self.roots)
        self._last = dict(self._first)
        self._halt.clear()
        self._thread = threading.Thread(target=self._loop, name="cpu-meter", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            self._sample()

    def stop(self) -> tuple[dict[str, float], dict[str, float]]:
        """(CPU seconds per part, per process name within its part)."""
        self._halt.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return cpu_by_part(self._first, self._last), cpu_by_part(self._first, self._last, by_name=True)


def cpu_by_part(first: dict[int, Seen], last: dict[int, Seen], by_name: bool = False) -> dict[str, float]:
    """Sum of each process's CPU between its first and last sample, per part, or per ``part/name`` (pure)."""
    totals: dict[str, float] = {}
    for pid, end in last.items():
        begin = first.get(pid, Seen(end.part, 0.0))
        key = f"{end.part}/{end.name}" if by_name else end.part
        totals[key] = totals.get(key, 0.0) + max(0.0, end.cpu_s - begin.cpu_s)
    return totals


def process_env(pid: int, name: str) -> str | None:
    """One environment variable of a process (e.g. the OMP_NUM_THREADS an engine runs with), or None."""
    try:
        for entry in psutil.Process(pid).environ().items():
            if entry[0] == name:
                return entry[1]
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    return None


def engine_threads(roots: dict[int, str]) -> dict[str, str]:
    """Each engine process (by name and pid): the OMP_NUM_THREADS it started with, its thread count and its
    niceness. Ray sets OMP_NUM_THREADS in a replica's own environment at run time, so its children show what
    it chose; Ray's raylet starts its workers at niceness 15 (RAY_worker_niceness) unless told otherwise."""
    out = {}
    for pid, seen in walk(roots).items():
        if seen.part != "engine":
            continue
        try:
            proc = psutil.Process(pid)
            out[f"{proc.name()}[{pid}]"] = (f"OMP_NUM_THREADS={process_env(pid, 'OMP_NUM_THREADS') or 'unset'}, "
                                            f"{proc.num_threads()} threads, nice {proc.nice()}")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def cpu_flags() -> list[str]:
    """The CPU's AVX-512 and AMX flags (what vLLM's CPU kernels choose by)."""
    if not os.path.exists("/proc/cpuinfo"):
        return []
    with open("/proc/cpuinfo") as info:
        for line in info:
            if line.startswith("flags"):
                return sorted({f for f in line.split(":", 1)[1].split() if f.startswith(("avx512", "amx"))})
    return []
