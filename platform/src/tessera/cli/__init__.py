"""The ``tessera`` command. Each command group lives in its own module and is registered here."""

from __future__ import annotations

import typer

from tessera.cli.doctor import doctor
from tessera.cli.engine import engine_app
from tessera.cli.gateway import gateway
from tessera.cli.model import model_app
from tessera.cli.plan import plan_app
from tessera.cli.tenants import keys_app, tenants_app
from tessera.cli.traces import traces_app
from tessera.cli.up import up

app = typer.Typer(no_args_is_help=True, add_completion=False, help="Tessera: multi-tenant LLM serving.")
app.add_typer(tenants_app, name="tenants")
app.add_typer(keys_app, name="keys")
app.add_typer(model_app, name="model")
app.add_typer(engine_app, name="engine")
app.add_typer(plan_app, name="plan")
app.add_typer(traces_app, name="traces")
app.command("up")(up)
app.command("doctor")(doctor)
app.command("gateway")(gateway)


def main() -> None:
    app()


__all__ = ["app", "main"]
