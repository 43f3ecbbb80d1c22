"""Which controller process controls which engine, when several share a fleet (``kvcontrol_shards``).

One process keeps up with about 50,000-70,000 KV events per CPU-second (docs/routing.md): a few dozen busy
replicas. Beyond that the engines are split among shards by a stable hash of the engine id
(``routing.hashing.stable_hash64``), so every shard agrees without talking to the others, each engine has
exactly one controller, and an engine keeps its shard (and its ledger) for as long as it lives. A replica
that is replaced gets a new id, and lands wherever that id hashes; changing the number of shards moves most
engines (their loops restart with empty ledgers, as after a controller restart).
"""

from __future__ import annotations

from tessera.routing.hashing import stable_hash64


def shard_of(engine_id: str, num_shards: int) -> int:
    """The shard in [0, num_shards) that controls ``engine_id``; the same in every process and Python
    version (``hash()`` of a str is salted per process, so it cannot be used)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if num_shards == 1:
        return 0
    return stable_hash64(engine_id) % num_shards
