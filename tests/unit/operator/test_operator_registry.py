"""The operator registers one handler per kind and event, named ``<kind>_<event>``, on the CRDs' group."""

from __future__ import annotations

import kopf

import tessera_operators.operator._main  # noqa: F401 - importing registers the handlers
from tessera_operators.operator import main
from tessera_operators.operator.crds import GROUP, VERSION


def test_handlers_are_registered_by_kind_and_event() -> None:
    registry = kopf.get_default_registry()
    resource_handlers = [*registry._changing.get_all_handlers(), *registry._spawning.get_all_handlers()]
    ids = {h.id.split("/")[0] for h in resource_handlers}
    expected = {f"tenant_{e}" for e in ("create", "update", "resume", "delete")}
    expected |= {f"model_{e}" for e in ("create", "update", "resume", "delete", "reconcile")}
    assert expected <= ids
    for handler in resource_handlers:
        if handler.id.split("/")[0] in expected:
            assert handler.selector is not None
            assert (handler.selector.group, handler.selector.version) == (GROUP, VERSION)
    activity_ids = {h.id for h in registry._activities.get_all_handlers()}
    assert {"operator_startup", "operator_cleanup"} <= activity_ids
    assert callable(main)
