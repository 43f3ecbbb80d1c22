"""The simulated engine (``tessera engine sim``): vLLM's prefix-cached block pool and continuous-batching
scheduler, timed by a step-time model instead of a GPU, behind the replica's own protocol.

One concept per module: ``block_pool`` (what is cached and evicted, and the KV events), ``hash_chain``
(the gateway's block hashes, grown with the output), ``scheduler`` (what each step computes),
``step_time`` (how long a step takes), ``kv_wire`` (vLLM's KV-event wire format and publisher),
``config`` (a replica's settings), ``engine`` (the scheduler stepped in simulated time), ``server`` (its
HTTP routes), ``fleet`` (many replicas in one process; import it from ``tessera.engine.sim.fleet``, it
pulls the HTTP server and Redis) and ``fleet_redis`` (the fleet's registry heartbeat and index feed).
"""

from tessera.engine.sim.block_pool import Block, BlockPool
from tessera.engine.sim.config import SimEngineConfig
from tessera.engine.sim.scheduler import SchedulingPolicy, SimRequest, SimScheduler, StepShape
from tessera.engine.sim.step_time import MeasuredStepTime, RooflineStepTime, StepTimeConfig, step_time_fn

__all__ = [
    "Block",
    "BlockPool",
    "MeasuredStepTime",
    "RooflineStepTime",
    "SchedulingPolicy",
    "SimEngineConfig",
    "SimRequest",
    "SimScheduler",
    "StepShape",
    "StepTimeConfig",
    "step_time_fn",
]
