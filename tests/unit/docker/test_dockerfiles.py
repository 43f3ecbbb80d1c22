"""What can be checked of the images without building them (no Docker engine here): pinned bases, a
numeric non-root user matching the chart, COPY sources that exist and pass .dockerignore, and versions
that agree with the chart and the Python packaging."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
DOCKERFILES = {
    "serving": REPO / "docker" / "serving.Dockerfile",
    "operator": REPO / "docker" / "operator.Dockerfile",
}
VALUES = yaml.safe_load((REPO / "helm" / "tessera" / "values.yaml").read_text())


@dataclass
class Stage:
    base: str
    copies: list[tuple[list[str], str]] = field(default_factory=list)  # (sources, --from stage or "")
    user: str | None = None


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        keyword, _, rest = line.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def _substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), m.group(0)), value)


def parse(path: Path) -> tuple[list[Stage], dict[str, str]]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in _instructions(path.read_text()):
        if keyword == "ARG" and "=" in rest:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            stages.append(Stage(base=_substitute(rest.split()[0], args)))
        elif keyword == "COPY":
            parts = rest.split()
            source_stage = next((p.split("=", 1)[1] for p in parts if p.startswith("--from=")), "")
            paths = [p for p in parts if not p.startswith("--")]
            stages[-1].copies.append((paths[:-1], source_stage))
        elif keyword == "USER":
            stages[-1].user = _substitute(rest, args)
    return stages, args


def dockerignore_excludes(relative: str) -> bool:
    """Docker's rule: the last matching pattern wins; a matching directory covers everything below it."""
    excluded = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = relative.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if pattern.startswith("**/"):
            matched = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            matched = any(
                fnmatch.fnmatch(prefix, pattern) and prefix.count("/") == pattern.count("/")
                for prefix in prefixes
            )
        if matched:
            excluded = not negate
    return excluded


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_bases_are_pinned(image: str) -> None:
    stages, _ = parse(DOCKERFILES[image])
    for stage in stages:
        base = stage.base
        if "@sha256:" in base:
            continue
        name, _, tag = base.rpartition(":")
        assert name and tag and tag != "latest" and re.search(r"\d+\.\d+", tag), (
            f"{image}: unpinned base {base}"
        )


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_final_stage_runs_as_the_charts_non_root_user(image: str) -> None:
    stages, _ = parse(DOCKERFILES[image])
    user = stages[-1].user
    assert user is not None, f"{image}: the final stage sets no USER"
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) != 0, f"{image}: USER {user} must be a numeric non-root UID"
    assert int(uid) == VALUES["podSecurityContext"]["runAsUser"]
    assert int(gid) == VALUES["podSecurityContext"]["runAsGroup"]


@pytest.mark.parametrize("image", sorted(DOCKERFILES))
def test_copied_files_exist_and_reach_the_build_context(image: str) -> None:
    stages, _ = parse(DOCKERFILES[image])
    copied = [
        src for stage in stages for sources, from_stage in stage.copies if not from_stage for src in sources
    ]
    assert copied, f"{image}: copies nothing from the context"
    for source in copied:
        assert (REPO / source).exists(), f"{image}: COPY {source} does not exist"
        assert not dockerignore_excludes(source), f"{image}: .dockerignore excludes {source}"


def test_dockerignore_keeps_local_state_out() -> None:
    for path in (
        ".venv/bin/python",
        ".git/config",
        "tests/unit/helm/chart_support.py",
        ".tessera/state",
        "platform/src/tessera/__pycache__/x.pyc",
        "operators/src/tessera_operators.egg-info/PKG-INFO",
    ):
        assert dockerignore_excludes(path), path
    assert not dockerignore_excludes("platform/src/tessera/engine/config.py")


def test_serving_image_versions_match_the_chart_and_packaging() -> None:
    _, args = parse(DOCKERFILES["serving"])
    assert args["RAY_VERSION"] == VALUES["rayService"]["rayVersion"]
    requirements = (REPO / "requirements.txt").read_text()
    assert f"ray[serve]=={args['RAY_VERSION']}" in requirements
    vllm_tag = args["VLLM_IMAGE"].rpartition(":v")[2]
    assert f"vllm=={vllm_tag}" in (REPO / "Makefile").read_text()


def test_operator_image_provides_the_charts_commands() -> None:
    scripts = tomllib.loads((REPO / "operators" / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tessera-operator"] == "tessera_operators.operator:main"
    assert "tessera-kvcontrol" in scripts
    stages, _ = parse(DOCKERFILES["operator"])
    copied = {src for stage in stages for sources, _ in stage.copies for src in sources}
    assert {"operators/src", "platform/src"} <= copied
    templates = REPO / "helm" / "tessera" / "templates"
    assert 'command: ["tessera-operator"]' in (templates / "operator.yaml").read_text()
    assert 'command: ["tessera-kvcontrol"]' in (templates / "kvcontrol.yaml").read_text()
