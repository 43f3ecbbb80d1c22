"""Runs a mixed multi-tenant workload on a real vLLM engine *in this process* (so the engine's own block pool
can be read) and prints, after every engine step, each tenant's blocks by the engine's own count and by a
``KVLedger`` fed only from the engine's ZMQ KV events. Used by tests/integration/kvcontrol/test_ledger_engine.py
in a subprocess: an in-process engine sets process-wide state (torch threads, a gloo group) a pytest process
should not carry.

Engine truth per tenant: every cached block in ``BlockPool.cached_block_hash_to_block`` (copies included)
whose hash belongs to one of the tenant's token sequences (its live requests' ``block_hashes``, and the
hash chains of its finished requests' prompt + output tokens, salted as vLLM salts them).

Usage (from the repository root): python -m tests.support.ledger_probe MODEL_DIR NUM_ROUNDS SEED
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections import Counter

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

TENANTS = {"alice": "salt-alice", "bob": "salt-bob", "carol": "salt-carol"}
NUM_GPU_BLOCKS = 48
BLOCK_SIZE = 32


def main(model_dir: str, rounds: int, seed: int) -> None:
    import msgspec
    import zmq
    from vllm import EngineArgs, SamplingParams
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.kv_cache_utils import get_block_hash
    from vllm.v1.engine.llm_engine import LLMEngine

    from tessera.engine.capabilities import ask_vllm, resolve
    from tessera.engine.config import EngineConfig
    from tessera.routing.hashing import block_hashes_bytes
    from tessera.routing.kv_events import decode_batch
    from tessera_operators.kvcontrol.ledger import KVLedger
    from tests.support.machine import free_port

    port = free_port()
    config = EngineConfig.model_validate({"model": model_dir, "num_gpu_blocks_override": NUM_GPU_BLOCKS,
                                          "block_size": BLOCK_SIZE, "max_model_len": 1024,
                                          "max_num_batched_tokens": 256})
    # As the host does: the KV dtype this CPU runs (FP8 needs AVX-512 or AMX; the ledger is the same in bf16).
    config = resolve(config, ask_vllm(config)).config
    engine = LLMEngine.from_engine_args(EngineArgs(**config.to_vllm_kwargs(kv_events_endpoint=f"tcp://*:{port}")))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # ZMQ's slow joiner: nothing is published before the first step anyway
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ledger = KVLedger()
    scheduler = engine.engine_core.engine_core.scheduler  # type: ignore[attr-defined]
    pool = scheduler.kv_cache_manager.block_pool
    owner_of_hash: dict[bytes, str] = {}
    salt_to_tenant = {salt: tenant for tenant, salt in TENANTS.items()}

    evicted = [0]

    def drain() -> None:
        while sub.poll(150):  # the publisher thread sends each step's batch right after the step
            _, seq, payload = sub.recv_multipart()
            update = ledger.apply(decode_batch(int.from_bytes(seq, "big"), decoder.decode(payload)))
            evicted[0] += len(update.evictions)

    def engine_truth() -> tuple[Counter[str], int]:
        for request in scheduler.requests.values():
            tenant = request.request_id.split("-")[0]
            for h in request.block_hashes:
                owner_of_hash[bytes(h)] = tenant
        counts: Counter[str] = Counter()
        unattributed = 0
        for key, blocks in pool.cached_block_hash_to_block._cache.items():
            copies = len(blocks) if isinstance(blocks, dict) else 1
            tenant = owner_of_hash.get(bytes(get_block_hash(key)))
            if tenant is None:
                unattributed += copies
            else:
                counts[tenant] += copies
        return counts, unattributed

    def record_finished(outputs: list) -> None:
        for out in outputs:
            if out.finished:
                tenant = out.request_id.split("-")[0]
                tokens = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
                for h in block_hashes_bytes(tokens, BLOCK_SIZE, TENANTS[tenant]):
                    owner_of_hash[h] = tenant

    rng = random.Random(seed)
    shared = {t: [rng.randrange(10, 700) for _ in range(256)] for t in TENANTS}
    step = 0
    num_requests = 0

    def report() -> None:
        truth, unattributed = engine_truth()
        print(json.dumps({"step": step, "truth": dict(truth), "unattributed": unattributed,
                          "ledger": ledger.owner_blocks(salt_to_tenant), "ledger_total": ledger.num_blocks,
                          "engine_total": sum(truth.values()) + unattributed,
                          "unknown_removals": ledger.num_unknown_removals, "evicted": evicted[0],
                          "free": pool.get_num_free_blocks(),
                          "running": len(scheduler.running), "waiting": len(scheduler.waiting)}), flush=True)

    for _ in range(rounds):
        for tenant, salt in TENANTS.items():
            if rng.random() < 0.6:
                # Mixed: a shared system prompt of varying length, then a fresh tail; varied outputs.
                prompt = shared[tenant][:rng.choice([64, 100, 256])]
                prompt = prompt + [rng.randrange(10, 700) for _ in range(rng.randrange(1, 400))]
                params = SamplingParams(max_tokens=rng.randrange(1, 80), ignore_eos=True, temperature=0.0)
                engine.add_request(f"{tenant}-{num_requests}", {"prompt_token_ids": prompt, "cache_salt": salt},
                                   params)
                num_requests += 1
        for _ in range(rng.randrange(1, 6)):
            record_finished(engine.step())
            step += 1
            drain()
            report()
    while engine.has_unfinished_requests():
        record_finished(engine.step())
        step += 1
        drain()
        report()
    print(json.dumps({"done": True, "requests": num_requests, "steps": step,
                      "missed_batches": ledger.num_missed_batches}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
