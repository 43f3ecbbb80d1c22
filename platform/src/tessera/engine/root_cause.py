"""Why an engine could not start, in one line, and the Tessera config key that changes it.

vLLM builds its engine in child processes. When one fails, the frontend raises only "Engine core
initialization failed. See root cause above." and the cause is in the child's log. ``capture_engine_errors``
has every vLLM child this process spawns also write its ERROR records to one file (through vLLM's own
``VLLM_LOGGING_CONFIG_PATH``: vLLM's default console logging plus that file), so the host can read the
cause back; ``last_exception_line`` and ``config_hint`` are pure.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from copy import deepcopy
from pathlib import Path

_EXCEPTION_LINE = re.compile(r"(?:^|\] )((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): .+)$")
# Exceptions that only wrap the cause (vLLM's frontend and executor, Ray): a line of one is a last resort.
_WRAPPERS = ("RuntimeError: Engine core initialization failed", "RuntimeError: Worker failed with error",
             "RayActorError", "RayTaskError", "ActorDiedError", "RuntimeError: Deploying application")
# vLLM's words for a setting -> the EngineConfig key (values files, the Model resource) that sets it.
_HINTS = (
    ("FP8 KV cache", "kvCacheDtype: auto (or leave kvCacheDtypeStrict: false to fall back by itself)"),
    ("VLLM_CPU_KVCACHE_SPACE", "cpuKvCacheSpaceGib, the KV space on CPU in GiB (the VLLM_CPU_KVCACHE_SPACE "
                               "environment variable overrides it)"),
    ("kv cache", "gpuMemoryUtilization, maxModelLen or numGpuBlocksOverride"),
    ("max_model_len", "maxModelLen"),
    ("block_size", "blockSize"),
    ("speculative", "speculative (method, draftModel) or speculative: null"),
    ("tensor_parallel_size", "tensorParallelSize"),
)


def last_exception_line(text: str) -> str | None:
    """The last ``SomeError: message`` line in a log or traceback, preferring causes over wrappers."""
    found = [m.group(1).strip() for line in text.splitlines() if (m := _EXCEPTION_LINE.search(line.strip()))]
    causes = [line for line in found if not line.startswith(_WRAPPERS)]
    return (causes or found or [None])[-1]


def config_hint(cause: str) -> str | None:
    """The EngineConfig key that addresses ``cause``, where vLLM's message names a setting Tessera sets."""
    lowered = cause.lower()
    return next((hint for needle, hint in _HINTS if needle.lower() in lowered), None)


class EngineErrorLog:
    """The file this process's vLLM engine children append their ERROR records to (None: not captured)."""

    def __init__(self) -> None:
        self.path = _configure_capture()
        self._offset = self.path.stat().st_size if self.path is not None and self.path.exists() else 0

    def cause(self) -> str | None:
        """The last exception line logged by an engine child since this log was opened."""
        if self.path is None or not self.path.exists():
            return None
        with self.path.open(encoding="utf-8", errors="replace") as log:
            log.seek(self._offset)
            return last_exception_line(log.read())


# Engines started in parallel threads call _configure_capture at once: one of them writes the file.
_CAPTURE_LOCK = threading.Lock()


def _configure_capture() -> Path | None:
    ours = Path(tempfile.gettempdir()) / f"tessera-vllm-logging-{os.getpid()}.json"
    errors = ours.with_suffix(".errors.log")
    with _CAPTURE_LOCK:
        current = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
        if current and Path(current) != ours:
            return None  # the operator's own vLLM logging config wins
        if current is None:
            from vllm.logger import DEFAULT_LOGGING_CONFIG

            config = deepcopy(DEFAULT_LOGGING_CONFIG)
            config["handlers"]["tessera_errors"] = {"class": "logging.FileHandler", "filename": str(errors),
                                                    "level": "ERROR", "formatter": "vllm", "delay": True}
            config["loggers"]["vllm"]["handlers"].append("tessera_errors")
            # NOTE: written aside and renamed into place: an engine child of another thread may be reading
            # the file (a rewrite in place was seen half-written by one: JSONDecodeError at its start).
            staged = ours.with_suffix(f".{threading.get_ident()}.tmp")
            staged.write_text(json.dumps(config))
            os.replace(staged, ours)
            # NOTE: set for the process, not per start: engines started in parallel threads would otherwise
            # race on the variable. vLLM reads it when a child process imports it, and this process's own
            # vLLM logging was configured at import, before this.
            os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(ours)
    return errors


def start_failure_line(error: BaseException, child_cause: str | None) -> str:
    """One line for an engine that could not start: the child's cause where the error only wraps it, and
    the config key that addresses it."""
    own = f"{type(error).__name__}: {error}".strip().splitlines()[0]
    if type(error).__name__ == "CapabilityError":
        return str(error)  # Tessera's own refusal names its fix already
    cause = child_cause if child_cause and (own.startswith(_WRAPPERS) or not str(error).strip()) else own
    hint = config_hint(cause)
    return f"{cause} [Tessera setting: {hint}]" if hint else cause
