"""The CPU's feature flags, as /proc/cpuinfo names them: read by ``tessera doctor`` (to show) and by
``tessera up`` (to pick the engine's OpenMP threads)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor (empty where the text has none: not x86, or no file)."""
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def read_cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        return cpu_flags(path.read_text())
    except OSError:
        return frozenset()
