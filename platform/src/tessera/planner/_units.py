"""Unit constants shared by the planner modules.

Memory sizes are binary (GiB, as drivers and allocators report them); bandwidths and FLOP rates are
decimal (GB/s, TFLOP/s, as datasheets print them). Every public value carries its unit in its name.
"""

from __future__ import annotations

KIB = 1024
MIB = 1024**2
GIB = 1024**3
GB = 1e9
TB = 1e12
TFLOP = 1e12


def to_gib(num_bytes: float) -> float:
    return num_bytes / GIB


def to_gb(num_bytes: float) -> float:
    return num_bytes / GB
