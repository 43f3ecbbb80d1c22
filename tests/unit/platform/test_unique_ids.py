"""tessera.unique_ids: the lease, response and request ids made without a system call per id."""

from __future__ import annotations

import multiprocessing

from tessera.unique_ids import PREFIX_BYTES, UniqueIds


def test_ids_are_the_prefix_the_random_part_and_a_hex_count() -> None:
    ids = UniqueIds()
    first, second = ids.next("chatcmpl-"), ids.next("chatcmpl-")
    assert first.startswith("chatcmpl-") and first != second
    random_part = first.removeprefix("chatcmpl-")[:2 * PREFIX_BYTES]
    assert second.removeprefix("chatcmpl-")[:2 * PREFIX_BYTES] == random_part
    assert [ids.next()[2 * PREFIX_BYTES:] for _ in range(16)][-1] == "11"  # counts 2..17 in hex


def _ids_in_a_child(queue: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    from tessera.gateway.request.call import process_unique_id
    queue.put([process_unique_id("req-") for _ in range(100)])


def test_two_sources_and_two_processes_never_make_the_same_id() -> None:
    a, b = UniqueIds(), UniqueIds()
    assert {a.next() for _ in range(1000)}.isdisjoint(b.next() for _ in range(1000))
    # Each gateway process draws its own random part (spawned, as uvicorn's workers are started afresh).
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    children = [context.Process(target=_ids_in_a_child, args=(queue,)) for _ in range(2)]
    for child in children:
        child.start()
    made = [queue.get(timeout=60) for _ in children]
    for child in children:
        child.join(timeout=30)
    assert len(set(made[0]) | set(made[1])) == 200
