"""A Model's ``status.conditions``: what an operator paged at 3 a.m. reads with `kubectl describe model`.

Three conditions, in the Kubernetes convention (``type``, ``status`` "True"/"False"/"Unknown", ``reason``
CamelCase, ``message`` for humans, ``lastTransitionTime`` that moves only when ``status`` changes):

- ``Applied``: the Model's Serve application is in the RayService's ``serveConfigV2``.
- ``EnginesRunning``: Ray Serve reports the application RUNNING (KubeRay copies Serve's application status
  into ``status.activeServiceStatus``) *and* as many engine replicas as ``spec.replicas`` heartbeat in the
  engine registry for the served model name. Both, because each can be wrong alone: Serve says RUNNING
  once its replicas passed their health check, the registry says the replicas can actually be routed to.
- ``Ready``: Applied and EnginesRunning — tenants' requests for this model will be served.

Everything here is pure: the handler passes what it read (the RayService, the number of live engines) and
the previous conditions, and writes what comes back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

JSON = dict[str, Any]
CONDITION_TYPES = ("Applied", "EnginesRunning", "Ready")
SERVE_RUNNING = "RUNNING"
SERVE_FAILED = ("DEPLOY_FAILED", "UNHEALTHY")


@dataclass(frozen=True, slots=True)
class ApplicationState:
    """Serve's view of one application, as KubeRay reports it; ``status`` None: not reported (yet)."""

    status: str | None = None
    message: str = ""
    deployments: dict[str, str] = field(default_factory=dict)  # deployment -> its Serve status


def application_state(ray_service: Mapping[str, Any] | None, application: str) -> ApplicationState:
    """The application's state from the RayService's ``status.activeServiceStatus`` (the cluster serving
    traffic); during an upgrade the pending cluster's view is used while the active one lacks the app."""
    status = (ray_service or {}).get("status") or {}
    for side in ("activeServiceStatus", "pendingServiceStatus"):
        apps = (status.get(side) or {}).get("applicationStatuses") or {}
        app = apps.get(application)
        if isinstance(app, Mapping):
            deployments = {str(name): str((d or {}).get("status", ""))
                           for name, d in (app.get("serveDeploymentStatuses") or {}).items()}
            return ApplicationState(app.get("status"), str(app.get("message") or ""), deployments)
    return ApplicationState()


def build_model_conditions(
    *,
    applied: bool,
    applied_message: str,
    app: ApplicationState,
    live_engines: int,
    wanted_replicas: int,
    served_model_name: str,
    generation: int | None,
    previous: Sequence[Mapping[str, Any]] | None,
    now: str,
) -> list[JSON]:
    """The three conditions; ``now`` (RFC 3339) stamps only the ones whose status changed."""
    applied_cond = ("True", "ServeConfigApplied", applied_message) if applied else ("False", "NotApplied",
                                                                                    applied_message)
    running = _engines_running(app, live_engines, wanted_replicas, served_model_name)
    if applied and running[0] == "True":
        ready = ("True", "Serving", f"{served_model_name!r} is served by {live_engines} engine replica(s)")
    elif not applied:
        ready = ("False", "NotApplied", "the Serve application is not in the RayService yet")
    else:
        ready = ("False" if running[0] == "False" else "Unknown", running[1], running[2])
    old = {c.get("type"): c for c in previous or ()}
    conditions = []
    for type_, (status, reason, message) in zip(CONDITION_TYPES, (applied_cond, running, ready), strict=True):
        before = old.get(type_)
        since = before.get("lastTransitionTime") if before and before.get("status") == status else None
        condition: JSON = {"type": type_, "status": status, "reason": reason, "message": message,
                           "lastTransitionTime": since or now}
        if generation is not None:
            condition["observedGeneration"] = generation
        conditions.append(condition)
    return conditions


def _engines_running(app: ApplicationState, live: int, wanted: int, served: str) -> tuple[str, str, str]:
    if app.status in SERVE_FAILED:
        failing = ", ".join(f"{d}={s}" for d, s in sorted(app.deployments.items()) if s != "HEALTHY")
        detail = f" ({failing})" if failing else ""
        return "False", "ServeDeployFailed", f"Ray Serve reports {app.status}{detail}: {app.message or 'no message'}"
    if live >= wanted and app.status in (SERVE_RUNNING, None):
        # Serve not reporting (an older KubeRay, or status not copied yet) is not held against live engines.
        return "True", "ReplicasRegistered", f"{live} of {wanted} engine replica(s) of {served!r} heartbeat"
    if app.status is None:
        return "Unknown", "WaitingForServe", (f"{live} of {wanted} engine replica(s) of {served!r} heartbeat; "
                                              "Ray Serve has not reported the application yet")
    return "False", "WaitingForReplicas", (f"{live} of {wanted} engine replica(s) of {served!r} heartbeat; "
                                           f"Ray Serve reports {app.status}")


def is_ready(conditions: Sequence[Mapping[str, Any]]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
