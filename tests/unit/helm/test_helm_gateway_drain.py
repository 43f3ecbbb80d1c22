"""The gateway pods drain on a rollout or scale-down (issue #16, gateway/drain.py): a preStop sleep so the
endpoints drop the pod first, the drain deadline handed to the gateway, and a grace period that covers the
sleep, the deadline and the billing of the streams cut at it before Kubernetes SIGKILLs the pod."""

from __future__ import annotations

from typing import Any

import helm_python
import pytest

from tessera.gateway.drain import EXIT_AFTER_DEADLINE_S
from tests.support.chart import env_values, find, render

JSON = dict[str, Any]


def _pod(values: JSON | None = None) -> JSON:
    spec: JSON = find(render(values), "Deployment", "-gateway")["spec"]["template"]["spec"]
    return spec


def _env(pod: JSON) -> dict[str, str]:
    return env_values(pod["containers"][0])


def test_defaults_sleep_before_sigterm_pass_the_deadline_and_cover_both_with_the_grace_period() -> None:
    pod = _pod()
    container = pod["containers"][0]
    assert container["lifecycle"]["preStop"] == {"exec": {"command": ["sleep", "5"]}}
    assert _env(pod)["TESSERA_DRAIN_TIMEOUT_S"] == "30"
    assert pod["terminationGracePeriodSeconds"] == 5 + 30 + 20


@pytest.mark.parametrize(("pre_stop_s", "timeout_s"), [(0, 1), (10, 300), (120, 3600)])
def test_the_grace_period_leaves_the_cut_streams_time_to_be_billed(pre_stop_s: int, timeout_s: int) -> None:
    pod = _pod({"gateway": {"drain": {"preStopSleepS": pre_stop_s, "timeoutS": timeout_s}}})
    assert _env(pod)["TESSERA_DRAIN_TIMEOUT_S"] == str(timeout_s)
    # After the deadline a worker exits within EXIT_AFTER_DEADLINE_S at worst (backstop, settling, finishes).
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_s + timeout_s + EXIT_AFTER_DEADLINE_S
    lifecycle = pod["containers"][0].get("lifecycle")
    assert (lifecycle is None) == (pre_stop_s == 0), lifecycle


@pytest.mark.parametrize("drain", [{"timeoutS": 0}, {"timeoutS": 2.5}, {"preStopSleepS": -1}, {"timeout": 30}])
def test_a_wrong_drain_value_fails_the_install(drain: JSON) -> None:
    with pytest.raises(helm_python.HelmValuesError):
        render({"gateway": {"drain": drain}})


def test_the_loop_watchdog_limit_reaches_the_gateway_and_a_negative_one_fails_the_install() -> None:
    """gateway.loopStallLimitS (gateway/loop_watchdog.py): a worker stuck this long is replaced."""
    assert _env(_pod())["TESSERA_LOOP_STALL_LIMIT_S"] == "10"
    assert _env(_pod({"gateway": {"loopStallLimitS": 0}}))["TESSERA_LOOP_STALL_LIMIT_S"] == "0"
    with pytest.raises(helm_python.HelmValuesError):
        render({"gateway": {"loopStallLimitS": -1}})
