"""The gateway's C steps (tessera/native_steps.py): each loads its built function unless its switch is "0", and a
module that is not built loads nothing, so its Python twin runs."""

from __future__ import annotations

import importlib

import pytest

from tessera.native_steps import NATIVE_STEPS, NativeStep
from tests.support.native_build import skip_where_nothing_can_be_built


@pytest.mark.parametrize("step", NATIVE_STEPS, ids=lambda step: step.env)
def test_a_built_step_loads_its_function_unless_switched_off(step: NativeStep, monkeypatch: pytest.MonkeyPatch) -> None:
    """make install builds each step where a compiler is; an optional build that silently failed would leave the
    step to its Python twin for good."""
    skip_where_nothing_can_be_built()
    monkeypatch.delenv(step.env, raising=False)
    assert step.built(), f"{step.module} did not build: run `make install`"
    module = importlib.import_module(step.module)
    assert step.load() is getattr(module, step.attribute)
    # Every function the module gives, named (a step of several: prefix_affinity's ring, fleet and rank), follows
    # the same switch.
    functions = [name for name in dir(module) if not name.startswith("_") and callable(getattr(module, name))]
    assert step.attribute in functions
    assert all(step.load(name) is getattr(module, name) for name in functions)
    monkeypatch.setenv(step.env, "0")
    assert step.forced_off() and step.load() is None
    assert all(step.load(name) is None for name in functions)
    assert step.built()  # what doctor reports beside the switch
    monkeypatch.setenv(step.env, "1")
    assert step.load() is not None


def test_a_step_whose_module_is_not_built_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = NativeStep("a step", "tessera/_nowhere.c", "tessera._nowhere", "run", "TESSERA_TEST_NATIVE_NOWHERE")
    monkeypatch.delenv(missing.env, raising=False)
    assert not missing.built() and not missing.forced_off() and missing.load() is None
