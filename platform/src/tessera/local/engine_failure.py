"""Why the engine replicas could not start, out of Ray Serve's status, and whether to wait for Serve's retries.

Ray reports a replica whose constructor raised as a deployment failure whose message is the whole remote
traceback, wrapped in Ray's own ("Deploying application tessera-engines failed", ``RayActorError``, ...).
The engine host raises ``EngineStartError`` with the cause and the config key that fixes it; this finds that
line, and otherwise the last exception line of the traceback, which is the closest to the cause.

Serve constructs a failing replica again (three times by default) before it calls the deployment failed, each
try loading the engine anew: a minute or more on a small CPU machine. Where the host raised
``EngineConfigRefused`` (a strict setting this platform cannot run), every try fails alike, so ``tessera up``
stops at the first, from the message Serve shows while it retries.
"""

from __future__ import annotations

from tessera.engine.root_cause import last_exception_line

REFUSED = "EngineConfigRefused: "
START_ERRORS = (REFUSED, "EngineStartError: ")
# Serve's application status once it gave up on the deployment (ray.serve.schema.ApplicationStatus).
DEPLOY_FAILED = "DEPLOY_FAILED"


def engine_failure_cause(message: str) -> str:
    """One line naming why the engine could not start (the message itself when nothing better is in it)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        for marker in START_ERRORS:
            if marker in line:
                return line.split(marker, 1)[1]
    return last_exception_line(message) or (lines[-1] if lines else "the engine deployment failed without a message")


def engines_failed(app_status: str, message: str) -> str | None:
    """The cause to stop on, given the engine application's status and its messages (the application's and its
    deployments'): Serve gave up (``DEPLOY_FAILED``), or a replica failed in a way no retry mends (``REFUSED``);
    None while Serve may still start it."""
    if app_status == DEPLOY_FAILED or REFUSED in message:
        return engine_failure_cause(message)
    return None
