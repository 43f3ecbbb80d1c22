"""Tessera's control plane: the kopf operator for Tenant and Model objects (``.operator``)."""

__all__: list[str] = []
