"""The gateway's steps in C, and how each is chosen: built by ``make install`` where a C compiler and Python's
headers are (platform/setup.py, ``optional=True``), each with a Python twin that gives the same results and runs
where the C one is not built, or where its switch (``<env>=0``) keeps it off. ``tessera doctor`` names which
implementation of each runs here.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class NativeStep:
    name: str  # what it is, for people
    source: str  # the C file
    module: str  # what the build makes, as the gateway imports it
    attribute: str  # the function the module gives
    env: str  # "0" here keeps the Python twin

    def forced_off(self) -> bool:
        return os.environ.get(self.env, "1") == "0"

    def built(self) -> bool:
        """The C module imports here (built, and for this interpreter), whatever the switch says."""
        return self._module() is not None

    def load(self, attribute: str | None = None) -> Any | None:
        """The C function (``attribute``, or the step's own), or None: not built here (the Python twin runs), or
        switched off."""
        module = None if self.forced_off() else self._module()
        return None if module is None else getattr(module, attribute or self.attribute)

    def _module(self) -> Any | None:
        try:
            return importlib.import_module(self.module)
        except ImportError:
            return None


# The relay's per-token step (gateway/delta_chunk.py).
RELAY_STEP = NativeStep("per-token step", "tessera/gateway/_delta_chunk.c", "tessera.gateway._delta_chunk",
                        "split_delta_chunk", "TESSERA_NATIVE_RELAY")
# A pod worker's replay of the other workers' change records (routing/pod_replay.py).
POD_REPLAY_STEP = NativeStep("pod decision's replay of the other workers' counts", "tessera/routing/_pod_replay.c",
                             "tessera.routing._pod_replay", "replay", "TESSERA_NATIVE_POD_VIEW")
# The local prefix index's lookup of a prompt's chain (routing/local_index.py).
CHAIN_LOOKUP_STEP = NativeStep("prefix index's lookup of a prompt's chain", "tessera/routing/_chain_lookup.c",
                               "tessera.routing._chain_lookup", "longest_prefixes", "TESSERA_NATIVE_CHAIN_LOOKUP")
# prefix_affinity's usual decision (routing/affinity_native.py; the policy in routing/policies.py is its twin).
AFFINITY_STEP = NativeStep("prefix_affinity's usual decision", "tessera/routing/_affinity_rank.c",
                           "tessera.routing._affinity_rank", "rank", "TESSERA_NATIVE_AFFINITY")
NATIVE_STEPS = (RELAY_STEP, POD_REPLAY_STEP, CHAIN_LOOKUP_STEP, AFFINITY_STEP)
