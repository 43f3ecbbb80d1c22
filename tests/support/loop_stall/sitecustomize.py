"""A fault for tests, loaded by a gateway started with this directory on PYTHONPATH: SIGUSR2 makes the
process's main thread block, as a deadlock on the event loop's own thread would (tests/integration/tenancy/
test_gateway_loop_watchdog.py). Python runs a signal handler in the main thread, that is, inside the loop."""

import signal
import time


def _stall_the_loop(signum: int, frame: object) -> None:
    time.sleep(3600)


signal.signal(signal.SIGUSR2, _stall_the_loop)
