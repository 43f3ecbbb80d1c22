"""Each vLLM engine step's attention work and time, written by the engine core itself: loaded into the processes
vLLM starts for ``bench_sim_calibration.py`` (this directory first on their ``PYTHONPATH``); does nothing in any
process without ``$TESSERA_BENCH_CORE_STEPS_OUT``.

Why here: vLLM's CPU platform spawns its engine-core process (a fresh interpreter), so a patch made in the bench's
own process never reaches the scheduler. The frontend's iteration details count a step's prompt tokens and
sequences, not the contexts its attention reads (``step_time_fit.attention_work`` counts them from the schedule),
and the frontend hears of steps late and in bunches; the engine core has both. Per step one line:
``iteration_index pairs context t``, ``t`` the core's ``perf_counter`` once the step's model output is in (the gap
between two lines is one whole step of the core, from one output to the next), joined with the frontend's details
by the iteration index they carry too.
"""

from __future__ import annotations

import os


def _install(path: str) -> None:
    import time
    from contextlib import contextmanager
    from typing import Any

    from vllm.v1.engine.core import EngineCore

    from tessera.engine.sim.step_time_fit import attention_work

    capture = EngineCore.capture_iteration_details
    fd: list[int] = []  # opened on the first step, in the process that steps

    @contextmanager
    def capture_with_shape(self: Any, scheduler_output: Any) -> Any:
        with capture(self, scheduler_output) as details:
            if details is None or scheduler_output is None:
                yield details
                return
            cached = scheduler_output.scheduled_cached_reqs
            computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
            computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
            pairs, context = attention_work(scheduler_output.num_scheduled_tokens, computed)
            yield details  # the model computes the step
            done = time.perf_counter()
            if not fd:
                fd.append(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
            os.write(fd[0], f"{details.iteration_index} {pairs} {context} {done}\n".encode())

    EngineCore.capture_iteration_details = capture_with_shape  # type: ignore[method-assign]


if _out := os.environ.get("TESSERA_BENCH_CORE_STEPS_OUT"):
    _install(_out)
