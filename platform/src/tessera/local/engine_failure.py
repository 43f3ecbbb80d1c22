"""The root cause of an engine replica that could not start, out of Ray Serve's status message.

Ray reports a replica whose constructor raised as a deployment failure whose message is the whole remote
traceback, wrapped in Ray's own ("Deploying application tessera-engines failed", ``RayActorError``, ...).
The engine host raises ``EngineStartError`` with the cause and the config key that fixes it; this finds that
line, and otherwise the last exception line of the traceback, which is the closest to the cause.
"""

from __future__ import annotations

from tessera.engine.root_cause import last_exception_line

START_ERROR = "EngineStartError: "


def engine_failure_cause(message: str) -> str:
    """One line naming why the engine could not start (the message itself when nothing better is in it)."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in reversed(lines):
        if START_ERROR in line:
            return line.split(START_ERROR, 1)[1]
    return last_exception_line(message) or (lines[-1] if lines else "the engine deployment failed without a message")
