"""The continuous-batching scheduler (scheduler.py): batching limits, chunked prefill, prefix hits,
preemption when blocks run out, and priority."""

from __future__ import annotations

import pytest

from tessera.engine.sim.block_pool import BlockPool
from tessera.engine.sim.hash_chain import BlockHashChain
from tessera.engine.sim.kv_wire import BlockStored
from tessera.engine.sim.scheduler import SchedulingPolicy, SimRequest, SimScheduler, Status
from tessera.routing.hashing import block_hash_chain

BLOCK = 4


def request(request_id: str, prompt_len: int, max_tokens: int = 3, priority: int = 0, arrival_s: float = 0.0,
            first_token: int = 1000) -> SimRequest:
    prompt = list(range(first_token, first_token + prompt_len))
    return SimRequest(request_id, prompt, max_tokens, BlockHashChain(prompt, BLOCK, None), priority=priority,
                      arrival_s=arrival_s)


def scheduler(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, chunked: bool = True,
              policy: SchedulingPolicy = "fcfs") -> SimScheduler:
    return SimScheduler(BlockPool(num_blocks, BLOCK), max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                        enable_chunked_prefill=chunked, policy=policy)


def step(sched: SimScheduler, now_s: float = 0.0) -> dict[str, int]:
    batch = sched.schedule(now_s)
    sched.update(batch, now_s, lambda r: 7)
    return batch.num_new_tokens


def test_max_num_seqs_caps_the_batch_and_the_rest_waits() -> None:
    sched = scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(request(f"r{i}", 5, first_token=100 * i))
    assert step(sched) == {"r0": 5, "r1": 5}
    assert sched.num_waiting == 1
    assert step(sched) == {"r0": 1, "r1": 1}  # decodes: one token each


def test_chunked_prefill_splits_a_prompt_over_the_token_budget_and_samples_only_at_its_end() -> None:
    sched = scheduler(budget=4)
    sched.add_request(request("long", 10))
    sched.add_request(request("short", 2, first_token=5000))
    batch = sched.schedule(0.0)
    assert batch.num_new_tokens == {"long": 4}
    assert batch.shape.num_prefill_tokens == 4
    out = sched.update(batch, 0.1, lambda r: 7)
    assert out.new_tokens == {}  # a chunk: no token yet
    assert step(sched) == {"long": 4}
    assert step(sched) == {"long": 2, "short": 2}  # the rest of the budget goes to the next waiting one
    assert sched.requests["long"].output_token_ids == [7]


def test_a_long_prefill_takes_at_most_the_threshold_a_step_while_others_run_or_wait() -> None:
    # vLLM's long_prefill_token_threshold: a short prompt that arrives behind a long one is computed beside its
    # chunks instead of after the whole prefill; a long prompt alone takes the budget.
    sched = SimScheduler(BlockPool(64, BLOCK), max_num_seqs=8, max_num_batched_tokens=16,
                         long_prefill_token_threshold=4)
    sched.add_request(request("long", 30))
    assert step(sched) == {"long": 16}  # alone: nobody to hold up
    sched.add_request(request("short", 3, first_token=5000))
    assert step(sched) == {"long": 4, "short": 3}
    assert sched.requests["short"].output_token_ids == [7]  # its first token, while "long" still prefills
    assert step(sched) == {"long": 4, "short": 1}
    uncapped = scheduler(budget=16)
    uncapped.add_request(request("long", 30))
    step(uncapped)
    uncapped.add_request(request("short", 3, first_token=5000))
    assert step(uncapped) == {"long": 14, "short": 2}  # the long prompt's rest first, the short one's chunk after
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        SimScheduler(BlockPool(8, BLOCK), max_num_seqs=1, max_num_batched_tokens=4, long_prefill_token_threshold=-1)


def test_without_chunked_prefill_a_prompt_over_the_budget_waits_and_blocks_the_queue() -> None:
    sched = scheduler(budget=4, chunked=False)
    sched.add_request(request("long", 10))
    sched.add_request(request("short", 2, first_token=5000))
    assert step(sched) == {}


def test_a_shared_prefix_is_a_hit_except_the_block_of_the_last_token() -> None:
    sched = scheduler()
    sched.add_request(request("a", 12, max_tokens=1))
    step(sched)  # a finishes; its blocks stay cached
    sched.add_request(request("b", 12, max_tokens=1))
    batch = sched.schedule(1.0)
    # 12 tokens = 3 full blocks, but the last token must be computed: 2 blocks hit, 4 tokens computed.
    assert batch.num_new_tokens == {"b": 4}
    assert sched.requests["b"].num_cached_tokens == 8


def test_decode_fills_blocks_and_announces_them_with_the_gateways_hashes() -> None:
    sched = scheduler()
    sched.add_request(request("a", 6, max_tokens=4))
    for _ in range(4):
        step(sched)
    stored = [h for e in sched.pool.take_events() if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored == list(block_hash_chain([*range(1000, 1006), 7, 7], BLOCK, None))


def test_running_out_of_blocks_preempts_the_last_running_request_which_recomputes_later() -> None:
    sched = scheduler(num_blocks=5)  # 4 usable blocks of 4 tokens
    sched.add_request(request("first", 7, max_tokens=6))
    sched.add_request(request("second", 7, max_tokens=6, first_token=5000))
    assert step(sched) == {"first": 7, "second": 7}  # 2 blocks each; the pool is full
    assert step(sched) == {"first": 1, "second": 1}  # each writes its 8th token into its second block
    # first's 9th token needs a third block: second is preempted (FCFS: the last one) and its blocks freed.
    batch = sched.schedule(2.0)
    assert batch.num_new_tokens == {"first": 1}
    assert batch.preempted == ("second",)
    second = sched.requests["second"]
    assert (second.status, second.num_computed_tokens, second.num_preemptions) == (Status.PREEMPTED, 0, 1)
    sched.update(batch, 2.0, lambda r: 7)
    while "first" in sched.requests:
        step(sched)
    # second comes back and recomputes its 9 tokens but its first block: first's third block evicted
    # second's tail block (freed tail first, least recently used), its head block is still a hit.
    assert step(sched) == {"second": 5}
    assert sched.num_preemptions == 1


def test_priority_orders_the_queue_and_preempts_the_lowest_priority_first() -> None:
    sched = scheduler(num_blocks=5, max_num_seqs=2, policy="priority")
    sched.add_request(request("low", 7, max_tokens=6, priority=5, arrival_s=0.0))
    sched.add_request(request("high", 7, max_tokens=6, priority=0, arrival_s=1.0, first_token=5000))
    sched.add_request(request("mid", 3, max_tokens=1, priority=1, arrival_s=0.5, first_token=9000))
    assert step(sched) == {"high": 7, "mid": 3}
    assert step(sched) == {"high": 1, "low": 7}
    # The pool is full; high's next block does not fit: low (priority 5) is preempted, though it arrived first.
    batch = sched.schedule(3.0)
    assert batch.preempted == ("low",)
    assert batch.num_new_tokens == {"high": 1}
    assert sched.requests["low"].num_preemptions == 1
    assert sched.requests["high"].num_preemptions == 0


def test_abort_frees_the_requests_blocks() -> None:
    sched = scheduler()
    sched.add_request(request("a", 9, max_tokens=5))
    step(sched)
    assert sched.pool.num_free_blocks == 63 - 3
    assert sched.abort("a") is not None
    assert sched.pool.num_free_blocks == 63
    assert sched.abort("a") is None
    assert not sched.has_work()


def test_a_bad_configuration_names_the_valid_policies() -> None:
    with pytest.raises(ValueError, match="fcfs, priority"):
        scheduler(policy="lifo")  # type: ignore[arg-type]


def test_the_prefill_backlog_is_the_prompt_tokens_before_each_first_token_less_cache_hits() -> None:
    """What the sim's heartbeat reports as ``pending_prefill_tokens`` (routing rule 6's backlog): every
    request's prompt not yet computed, a waiting one's cached blocks taken off, nothing once its first token
    is out."""
    sched = scheduler(budget=4)
    sched.add_request(request("a", 12, max_tokens=2))
    assert sched.pending_prefill_tokens == 12
    assert step(sched) == {"a": 4}  # a chunk
    sched.add_request(request("b", 6, first_token=5000))
    assert sched.pending_prefill_tokens == 8 + 6
    step(sched)
    step(sched)  # a's last chunk: its first token
    b = sched.requests["b"]
    assert sched.requests["a"].output_token_ids and sched.pending_prefill_tokens == 6 - b.num_computed_tokens
    while sched.has_work():
        step(sched)
    sched.add_request(request("c", 12, max_tokens=1))  # a's prompt, cached: two blocks hit
    assert sched.pending_prefill_tokens == 4
