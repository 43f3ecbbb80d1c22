"""Tessera data plane: engine host, gateway, tenancy, routing, telemetry and planner."""

__version__ = "0.1.0"
__all__ = ["__version__"]
