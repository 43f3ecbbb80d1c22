"""The Tessera operator: kopf handlers for ``Tenant`` and ``Model`` objects (``tessera.dev/v1alpha1``).

``builders`` makes objects (pure functions), ``handlers`` applies them (thin, idempotent), ``kube`` is the
Kubernetes adapter the handlers call through, ``crds`` generates the CRDs shipped in the Helm chart.
"""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    """Entry point ``tessera-operator``: runs kopf on the handlers, watching one namespace."""
    from tessera_operators.operator._main import run

    run()
