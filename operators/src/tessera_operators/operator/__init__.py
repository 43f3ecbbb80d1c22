"""The Tessera operator: kopf handlers for ``Tenant`` and ``Model`` objects (``tessera.dev/v1alpha1``).

``builders`` makes objects (pure functions), ``handlers`` applies them (thin, idempotent), ``kube`` is the
Kubernetes adapter the handlers call through, ``crds`` generates the CRDs shipped in the Helm chart.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# The one shared TESSERA_* setting the operator reads, described for the operator (the shared description
# speaks of the CLI); its own TESSERA_OPERATOR_* settings are listed from OperatorSettings.
SHARED_SETTINGS_READ = {"redis_url": "Redis URL the tenants are kept in, redis://[:password@]host:port/db or "
                        "redis+sentinel://[:password@]host1:26379,host2:26379/<primary-name>[/db] (required)."}
DESCRIPTION = """Run the Tessera operator: reconcile Tenant and Model objects (tessera.dev/v1alpha1)
in one namespace with kopf, keeping tenants in Redis. It takes no arguments."""


def environment_help() -> str:
    """The environment variables the operator reads, one a line with its description and default."""
    # NOTE: built from OperatorSettings itself (pydantic only, no kopf), so the help cannot drift from it.
    from tessera.settings import TesseraSettings

    from .settings import OperatorSettings

    prefix = OperatorSettings.model_config.get("env_prefix", "")
    described = dict(SHARED_SETTINGS_READ)
    for name, field in OperatorSettings.model_fields.items():
        if name not in TesseraSettings.model_fields:
            described[name] = f"{field.description} Default: {field.default}."
    lines = ["environment (the operator takes its settings from these variables only):"]
    lines += [f"  {(prefix + name).upper()}\n      {text}" for name, text in described.items()]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(
        prog="tessera-operator",
        description=DESCRIPTION,
        epilog=environment_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point ``tessera-operator``: runs kopf on the handlers, watching one namespace."""
    # NOTE: arguments are parsed before kopf is imported: ``--help`` (or a wrong argument) answers at once
    # and never starts the operator.
    build_parser().parse_args(argv)
    from tessera_operators.operator._main import run

    run()
