"""All checks of the Helm chart (``make helm-check``), with no cluster and no ``helm`` binary:

1. the generated files (values.schema.json, crds/) match EngineConfig, TenantPolicy and the CRD builders;
2. ``helm lint --strict`` (Helm's own Go engine, via helm-python-sdk) with the defaults and every ci/ file;
3. the chart tests: render with every ci/ values file, validate each object against the Kubernetes 1.30
   schemas and the KubeRay RayService CRD, strict values schema, engine settings equal to EngineConfig,
   restricted Pod Security Standard and secret handling, NetworkPolicies, and the CRDs' schemas.

Exit status 0 only when everything passes.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import helm_python
import yaml

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "helm" / "tessera"
KUBE_VERSION = "v1.30.0"
TESTS = ["tests/unit/helm", "tests/unit/operator/test_operator_crds.py"]


def check_generated() -> bool:
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_chart_schema.py"), "--check"], check=False
    )
    print(f"generated files: {'current' if result.returncode == 0 else 'STALE'}")
    return result.returncode == 0


def check_lint() -> bool:
    ok = True
    cases: list[tuple[str, dict[str, object] | None]] = [("(defaults)", None)]
    for path in sorted((CHART / "ci").glob("*-values.yaml")):
        cases.append((path.name, yaml.safe_load(path.read_text()) or {}))
    for label, values in cases:
        report = helm_python.lint(CHART, values, strict=True, kube_version=KUBE_VERSION)
        problems = [f"{m['path']}: {m['error']}" for m in report["messages"] if m["severity"] >= 2]
        problems += list(report["errors"])
        ok = ok and not problems
        print(f"lint {label:45s} {'ok' if not problems else 'FAILED'}")
        for problem in problems:
            print(f"    {problem}")
    return ok


def run_tests() -> bool:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    return subprocess.run(command, cwd=REPO, check=False).returncode == 0


def main() -> int:
    results = {"generated files": check_generated(), "lint": check_lint(), "chart tests": run_tests()}
    failed = [name for name, ok in results.items() if not ok]
    print("helm-check:", "all passed" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
