"""Every console script answers ``--help`` at once: usage on stdout, exit 0, and no side effect (no file
written, no process left running, no operator started), without importing the serving stack.

The scripts are read from the ``[project.scripts]`` tables of the three distributions, so a new entry point
is covered without editing this file. No timings are asserted: they belong to ``make bench-cli``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = ("platform", "operators", "loadgen")
BIN = Path(sys.executable).parent
# Seconds: only a guard against a script that starts serving instead of answering; never a benchmark.
HANG_GUARD_S = 300
# The serving stack: seconds to import, and Triton prints a notice on machines without its CPU backend.
HEAVY_MODULES = ("vllm", "torch", "triton", "ray", "transformers")
# Clients no --help needs (the Redis client also pulls OpenTelemetry).
CLIENT_MODULES = ("redis", "httpx", "opentelemetry")
TRITON_NOTICE = "Triton is installed"


def console_scripts() -> list[str]:
    names: list[str] = []
    for distribution in DISTRIBUTIONS:
        project = tomllib.loads((REPO / distribution / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        names += project.get("scripts", {})
    return sorted(names)


def quiet_environment(home: Path) -> dict[str, str]:
    """This environment without any TESSERA_* setting (no Redis URL, no state directory elsewhere), and with
    a HOME of its own, so that a cache or config file written on start shows up."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("TESSERA_")}
    env["HOME"] = str(home)
    return env


def run_isolated(command: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """Runs ``command`` in an empty directory, in a session of its own; asserts it left no file there or
    in its HOME, and no process of its session running (a server it started, a daemon)."""
    work, home = tmp_path / "work", tmp_path / "home"
    work.mkdir()
    home.mkdir()
    proc = subprocess.Popen(command, cwd=work, env=quiet_environment(home), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    left_running = True
    try:
        os.killpg(proc.pid, 0)
    except ProcessLookupError:
        left_running = False
    if left_running:
        os.killpg(proc.pid, 9)
    assert not left_running, f"{command} left processes running"
    assert sorted(work.rglob("*")) == [], f"{command} wrote files in its working directory"
    assert sorted(home.rglob("*")) == [], f"{command} wrote files in HOME"
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def test_the_three_distributions_declare_their_scripts() -> None:
    assert {"tessera", "tessera-operator", "tessera-kvcontrol", "tessera-loadgen"} <= set(console_scripts())


@pytest.mark.parametrize("script", console_scripts())
def test_script_answers_help_without_side_effects(script: str, tmp_path: Path) -> None:
    result = run_isolated([str(BIN / script), "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "usage" in result.stdout.lower(), result.stdout
    assert TRITON_NOTICE not in result.stderr
    assert "Traceback" not in result.stderr
    # The operator used to start kopf on --help and fail on its start-up check.
    assert "kopf." not in result.stderr and "is not set" not in result.stderr, result.stderr


# Imports the CLI, asks every command of it for --help (the command tree is walked, so a command added
# later is covered too), then prints the top-level packages of the modules loaded.
EVERY_TESSERA_HELP = """
import sys
from typer.main import get_command
from typer.testing import CliRunner
from tessera.cli import app

def paths(command, path):
    yield path
    for name, sub in getattr(command, "commands", {}).items():
        yield from paths(sub, [*path, name])

runner = CliRunner()
for path in paths(get_command(app), []):
    result = runner.invoke(app, [*path, "--help"])
    assert result.exit_code == 0 and "Usage" in result.output, (path, result.output)
print(" ".join(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_every_tessera_command_answers_help_without_the_serving_stack(tmp_path: Path) -> None:
    result = run_isolated([sys.executable, "-c", EVERY_TESSERA_HELP], tmp_path)
    assert result.returncode == 0, result.stderr
    loaded = set(result.stdout.split())
    assert loaded.isdisjoint(HEAVY_MODULES), sorted(loaded & set(HEAVY_MODULES))
    assert loaded.isdisjoint(CLIENT_MODULES), sorted(loaded & set(CLIENT_MODULES))
    assert TRITON_NOTICE not in result.stderr


@pytest.mark.parametrize("module", ["tessera.cli", "tessera_loadgen.cli", "tessera_operators.operator",
                                    "tessera_operators.kvcontrol"])
def test_importing_a_command_module_loads_no_heavy_module(module: str, tmp_path: Path) -> None:
    code = f"import sys, {module}; print(' '.join(sorted({{name.split('.')[0] for name in sys.modules}})))"
    result = run_isolated([sys.executable, "-c", code], tmp_path)
    assert result.returncode == 0, result.stderr
    loaded = set(result.stdout.split())
    assert loaded.isdisjoint(HEAVY_MODULES), sorted(loaded & set(HEAVY_MODULES))
    assert loaded.isdisjoint(CLIENT_MODULES), sorted(loaded & set(CLIENT_MODULES))
