"""Unit constants shared by the planner modules.

Memory sizes are binary (GiB, as drivers and allocators report them); bandwidths and FLOP rates are
decimal (GB/s, TFLOP/s, as datasheets print them). Every public value carries its unit in its name.
"""

from __future__ import annotations

KIB = 1024
MIB = 1024**2
GIB = 1024**3
GB = 1e9
TFLOP = 1e12
