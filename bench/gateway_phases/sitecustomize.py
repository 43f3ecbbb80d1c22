"""The gateway's CPU per request, phase by phase: loaded into a ``tessera gateway`` process by
``bench_gateway_cpu.py --phases`` (this directory first on its ``PYTHONPATH``); does nothing in any other process.

Each phase of ``GenerationPipeline.handle`` (gateway/request/pipeline.py) and each protocol callback that reads a
socket (the client's request, Redis replies, engine chunks) is wrapped to add up the main thread's CPU clock
(``time.thread_time_ns``: user and system time, the system calls it makes included) while it runs. A phase
that awaits counts what the loop ran meanwhile: the engine's chunks inside ``call_engine``, Redis replies
inside ``admit`` and ``settle`` (the bench sends one request at a time, so nothing of another request).
What the wrappers cannot see is the loop's own work between callbacks: waking from ``epoll_wait``, the
``recv`` that fetched the bytes, going back to sleep; that is the request's whole figure less its callbacks.
A profiler's figures are inflated unevenly by its own per-call cost; these are the CPU clock's, with one
wrapper call per phase or callback added (the whole figure probed: 3.2-3.9 ms a request, against 3.1-3.4 in
unprobed runs of the same code on the same VM: up to ~15 %, within this machine's run-to-run spread).

SIGUSR1 starts the count afresh; SIGUSR2 writes it as JSON to ``$TESSERA_BENCH_PHASES_OUT``: per name, the
number of calls and the nanoseconds spent.
"""

from __future__ import annotations

import os
import sys


def _install() -> None:
    import functools
    import json
    import signal
    import time
    from collections.abc import Awaitable, Callable
    from typing import Any

    clock = time.thread_time_ns
    spent: dict[str, list[int]] = {}  # name -> [calls, nanoseconds]
    process_start = [time.process_time_ns()]

    def add(name: str, ns: int) -> None:
        tally = spent.get(name)
        if tally is None:
            tally = spent[name] = [0, 0]
        tally[0] += 1
        tally[1] += ns

    def timed_async(name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(fn)
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return await fn(*args, **kwargs)
            finally:
                add(name, clock() - start)
        return wrapper

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                add(name, clock() - start)
        return wrapper

    import uvicorn.protocols.http.httptools_impl as uvicorn_http

    from tessera import redis_wire
    from tessera.gateway import app, http_wire
    from tessera.gateway.request import admit, pipeline

    # The phases, looked up by name in pipeline.py's globals at each call (a revision without one: not counted).
    for phase in ("read", "authenticate", "prepare_prompt", "route", "call_engine", "settle"):
        if hasattr(pipeline, phase):
            setattr(pipeline, phase, timed_async(phase, getattr(pipeline, phase)))
    # (The wrappers keep each function's signature; mypy cannot see that through ``functools.wraps``.)
    pipeline.parse = timed("parse", pipeline.parse)
    admit.Admitter.run = timed_async("admit", admit.Admitter.run)  # type: ignore[method-assign, assignment]
    app.Gateway.__call__ = timed_async("request", app.Gateway.__call__)  # type: ignore[method-assign, assignment]
    # The callbacks that read sockets (set on the classes before any connection binds them).
    uvicorn_http.HttpToolsProtocol.data_received = timed(  # type: ignore[method-assign]
        "client reads", uvicorn_http.HttpToolsProtocol.data_received)
    redis_wire._Protocol.data_received = timed(  # type: ignore[method-assign]
        "redis reads", redis_wire._Protocol.data_received)
    http_wire._Connection.data_received = timed(  # type: ignore[method-assign]
        "engine reads", http_wire._Connection.data_received)
    # The background between requests: each refresher's reads (by its name), the server's tick, the settler's
    # probe and the local index feed's own stream reads (a read that rides an admission is in ``admit``).
    from tessera import refresher
    from tessera.gateway import lean_server
    from tessera.routing import local_feed
    from tessera.tenancy import admission

    refresher_init = refresher.UsageRefresher.__init__

    def timed_refresher(self: Any, name: str, refresh: Callable[[], Awaitable[None]], *args: Any,
                        **kwargs: Any) -> None:
        refresher_init(self, name, timed_async(f"background: {name}", refresh), *args, **kwargs)

    refresher.UsageRefresher.__init__ = timed_refresher  # type: ignore[method-assign]
    lean_server.LeanServer.on_tick = timed_async(  # type: ignore[method-assign, assignment]
        "background: tick", lean_server.LeanServer.on_tick)
    admission.Admission.any_due = timed_async(  # type: ignore[method-assign, assignment]
        "background: settler probe", admission.Admission.any_due)
    local_feed.LocalIndexFeed.poll = timed_async(  # type: ignore[method-assign, assignment]
        "background: index feed read", local_feed.LocalIndexFeed.poll)

    def restart(*_: object) -> None:
        spent.clear()
        process_start[0] = time.process_time_ns()

    def write(*_: object) -> None:
        figures = {name: {"calls": calls, "ns": ns} for name, (calls, ns) in spent.items()}
        figures["process"] = {"calls": 1, "ns": time.process_time_ns() - process_start[0]}
        path = os.environ["TESSERA_BENCH_PHASES_OUT"]
        with open(path + ".part", "w") as out:
            json.dump(figures, out)
        os.replace(path + ".part", path)  # whole, for the bench that waits for it

    signal.signal(signal.SIGUSR1, restart)
    signal.signal(signal.SIGUSR2, write)


if os.environ.get("TESSERA_BENCH_PHASES_OUT") and sys.argv[0].endswith("tessera") and "gateway" in sys.argv:
    _install()
