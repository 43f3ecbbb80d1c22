"""The run-wide indices that every evidence builder reads (built once per analysis by analyze.py)."""

from __future__ import annotations

from dataclasses import dataclass

from tessera.telemetry.occupancy import EngineLoad, GatewayLoad
from tessera.telemetry.prefill_curve import PrefillCurves


@dataclass(frozen=True, slots=True)
class RunContext:
    """The run-wide indices the evidence is read from (built once per analysis)."""

    engines: EngineLoad
    gateway: GatewayLoad
    prefill: PrefillCurves
