"""A Model's conditions (operator/conditions.py): what each combination of Serve's report and the registry's
live replicas says, and that lastTransitionTime moves only when a condition's status does."""

from __future__ import annotations

from typing import Any

from tessera_operators.operator.conditions import ApplicationState, application_state, build_model_conditions

T0, T1 = "2026-12-01T10:00:00Z", "2026-12-01T10:05:00Z"


def _conditions(app: ApplicationState, live: int, previous: list[dict[str, Any]] | None = None,
                applied: bool = True, now: str = T0) -> dict[str, dict[str, Any]]:
    out = build_model_conditions(applied=applied, applied_message="m", app=app, live_engines=live,
                                 wanted_replicas=2, served_model_name="llama", generation=3, previous=previous,
                                 now=now)
    return {c["type"]: c for c in out}


def test_ready_needs_serve_running_and_every_replica_heartbeating() -> None:
    running = ApplicationState("RUNNING")
    assert _conditions(running, 2)["Ready"]["status"] == "True"
    assert _conditions(running, 2)["EnginesRunning"]["reason"] == "ReplicasRegistered"
    one_short = _conditions(running, 1)
    assert one_short["EnginesRunning"]["status"] == "False"
    assert "1 of 2" in one_short["EnginesRunning"]["message"]
    assert one_short["Ready"]["status"] == "False" and one_short["Ready"]["reason"] == "WaitingForReplicas"
    deploying = _conditions(ApplicationState("DEPLOYING"), 2)
    assert deploying["EnginesRunning"]["status"] == "False" and "DEPLOYING" in deploying["Ready"]["message"]


def test_a_failed_deployment_names_the_failing_deployment_and_serves_message() -> None:
    failed = ApplicationState("DEPLOY_FAILED", "replica died: CUDA out of memory",
                              {"engine": "UNHEALTHY", "other": "HEALTHY"})
    conditions = _conditions(failed, 0)
    running = conditions["EnginesRunning"]
    assert running["status"] == "False" and running["reason"] == "ServeDeployFailed"
    assert "engine=UNHEALTHY" in running["message"] and "other" not in running["message"]
    assert "CUDA out of memory" in running["message"]
    assert conditions["Ready"]["status"] == "False"


def test_serve_not_reporting_is_unknown_until_replicas_heartbeat() -> None:
    assert _conditions(ApplicationState(), 0)["EnginesRunning"]["status"] == "Unknown"
    assert _conditions(ApplicationState(), 0)["Ready"]["status"] == "Unknown"
    assert _conditions(ApplicationState(), 2)["Ready"]["status"] == "True"


def test_not_applied_is_never_ready() -> None:
    conditions = _conditions(ApplicationState("RUNNING"), 2, applied=False)
    assert conditions["Applied"]["status"] == "False"
    assert conditions["Ready"]["status"] == "False" and conditions["Ready"]["reason"] == "NotApplied"


def test_last_transition_time_moves_only_with_status() -> None:
    first = list(_conditions(ApplicationState("DEPLOYING"), 0, now=T0).values())
    later = _conditions(ApplicationState("RUNNING"), 2, previous=first, now=T1)
    assert later["Applied"]["lastTransitionTime"] == T0  # still True
    assert later["EnginesRunning"]["lastTransitionTime"] == T1  # False -> True
    assert later["Ready"]["lastTransitionTime"] == T1
    again = _conditions(ApplicationState("RUNNING"), 2, previous=list(later.values()), now="2026-12-01T11:00:00Z")
    assert [c["lastTransitionTime"] for c in again.values()] == [T0, T1, T1]
    assert all(c["observedGeneration"] == 3 for c in again.values())


def test_application_state_reads_kuberays_status_and_falls_back_to_the_pending_cluster() -> None:
    app = {"status": "RUNNING", "message": "", "serveDeploymentStatuses": {"engine": {"status": "HEALTHY"}}}
    active = {"status": {"activeServiceStatus": {"applicationStatuses": {"llama": app}}}}
    assert application_state(active, "llama") == ApplicationState("RUNNING", "", {"engine": "HEALTHY"})
    pending = {"status": {"activeServiceStatus": {"applicationStatuses": {}},
                          "pendingServiceStatus": {"applicationStatuses": {"llama": {"status": "DEPLOYING"}}}}}
    assert application_state(pending, "llama").status == "DEPLOYING"
    assert application_state({"status": {}}, "llama") == ApplicationState()
    assert application_state(None, "llama") == ApplicationState()
