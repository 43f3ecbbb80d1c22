"""Whether this machine could build the C steps (tessera/native_steps.py): a C compiler and Python's headers. Where
it could not, `make install` installs all the same and the Python twins run, so a test of the built step skips."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest


def skip_where_nothing_can_be_built() -> None:
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine: the Python twins are the ones that run")
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no Python headers on this machine: the Python twins are the ones that run")
