"""The shared KV-event wire format (routing/kv_wire.py): its read views name vLLM's own tags and fields, decode
vLLM's own bytes as vLLM's decoder does (less what each view leaves out), and need no vLLM to do it."""

from __future__ import annotations

import subprocess
import sys
import typing

import msgspec
import pytest
from vllm.distributed import kv_events as vllm_events

from tessera.routing import kv_wire
from tessera.routing.kv_events import decode_batch

VLLM_EVENTS = {cls.__name__: cls for cls in (vllm_events.BlockStored, vllm_events.BlockRemoved,
                                            vllm_events.AllBlocksCleared)}


def _names(struct: type[msgspec.Struct]) -> list[str]:
    return [f.name for f in msgspec.structs.fields(struct)]


def _event_types(batch: type[msgspec.Struct]) -> tuple[type[msgspec.Struct], ...]:
    (union,) = typing.get_args(typing.get_type_hints(batch)["events"])
    return typing.get_args(union)


@pytest.mark.parametrize("batch", [kv_wire.KVEventBatch, kv_wire.HashesBatch, kv_wire.ChainsBatch])
def test_every_struct_names_vllms_tag_and_fields(batch: type[msgspec.Struct]) -> None:
    # A batch is an array: its fields are read by position, so they must be vLLM's first ones, in order.
    assert _names(batch) == _names(vllm_events.KVEventBatch)[:len(_names(batch))]
    for event in _event_types(batch):
        tag = event.__struct_config__.tag
        assert tag in VLLM_EVENTS, f"{event.__name__}: no vLLM event is tagged {tag!r}"
        vllm_event = VLLM_EVENTS[tag]
        # A misspelt field would never be on the wire, and would decode as its default without a word.
        assert set(_names(event)) <= set(_names(vllm_event)), f"{event.__name__} names fields vLLM does not send"
        required = {f.name for f in msgspec.structs.fields(event) if f.required}
        assert required <= {f.name for f in msgspec.structs.fields(vllm_event) if f.required}


def vllm_bytes() -> bytes:
    """A batch as vLLM's ZmqEventPublisher encodes it, with the fields no view declares and both hash forms."""
    digest = bytes(range(32))
    return msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=2.5, data_parallel_rank=0, events=[
        vllm_events.BlockStored(block_hashes=[11, 12, 13], parent_block_hash=None, token_ids=list(range(6)),
                                block_size=2, lora_id=None, medium="GPU", lora_name=None,
                                extra_keys=[(("mm-image", 0), "salt-a"), (("mm-image", 2),), None], group_idx=0,
                                kv_cache_spec_kind="full_attention", locality="LOCAL", session_id="s-1"),
        vllm_events.BlockStored(block_hashes=[99], parent_block_hash=13, token_ids=[1, 2], block_size=2,
                                lora_id=None, medium="CPU", lora_name=None),  # offloaded: not the engine's cache
        vllm_events.BlockRemoved(block_hashes=[12, digest], medium="GPU", group_idx=0, ownership="tier-2"),
        vllm_events.BlockRemoved(block_hashes=[99], medium="STORAGE"),
        vllm_events.AllBlocksCleared(),
        vllm_events.BlockStored(block_hashes=[digest], parent_block_hash=digest, token_ids=[5, 6], block_size=2,
                                lora_id=None, medium=None, lora_name=None, extra_keys=[("salt-b",)]),
    ]))


def test_the_views_decode_vllms_bytes_as_vllms_decoder_does() -> None:
    payload = vllm_bytes()
    full = decode_batch(4, msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch).decode(payload))
    hashes = kv_wire.decode_hashes(4, kv_wire.hashes_decoder().decode(payload))
    chains = kv_wire.decode_chains(4, kv_wire.chains_decoder().decode(payload))
    low = int.from_bytes(bytes(range(24, 32)), "big")
    assert full.ops == [("store", 11), ("store", 12), ("store", 13), ("remove", 12), ("remove", low), ("clear", 0),
                        ("store", low)]
    assert (hashes.seq, hashes.ts, hashes.ops, hashes.stored_blocks) == (4, 2.5, full.ops, [])
    assert (chains.seq, chains.ts, chains.ops) == (4, 2.5, full.ops)
    assert chains.stored_blocks == [(h, parent, [], salt) for h, parent, _, salt in full.stored_blocks] == [
        (11, None, [], "salt-a"), (12, 11, [], None), (13, 12, [], None), (low, low, [], "salt-b")]


def test_the_sims_bytes_decode_as_vllms_do() -> None:
    event = kv_wire.BlockStored(block_hashes=[7, 8], parent_block_hash=6, token_ids=[1, 2, 3, 4], block_size=2,
                                lora_id=None, medium=kv_wire.MEDIUM_GPU, lora_name=None, extra_keys=[None, None])
    chains = kv_wire.decode_chains(0, kv_wire.chains_decoder().decode(kv_wire.encode_batch(1.0, [event])))
    assert chains.stored_blocks == [(7, 6, [], None), (8, 7, [], None)]


def test_block_hash_keys_and_cache_salts() -> None:
    assert kv_wire.block_hash_key(2**63 + 5) == 2**63 + 5
    assert kv_wire.block_hash_key(b"\x01" + b"\x00" * 7 + b"\x00" * 7 + b"\x09") == 9
    assert kv_wire.block_hash_key(b"\xff" * 32) == 2**64 - 1
    assert kv_wire.cache_salt((("mm", 0), "salt")) == "salt"
    assert kv_wire.cache_salt((("mm", 0),)) is None
    assert kv_wire.cache_salt(None) is None and kv_wire.cache_salt(()) is None


def test_the_feed_and_the_controller_decode_without_importing_vllm() -> None:
    """Importing vLLM costs seconds of CPU and hundreds of MB: the index feed on every replica, a fleet of
    simulated engines and the controller must not pay it (see controller.py ``run_forever``)."""
    code = (
        "import sys\n"
        "from tessera.engine.sim.kv_wire import KVEventPublisher\n"
        "from tessera.routing.kv_events import KVEventSubscriber\n"
        "from tessera_operators.kvcontrol.events import LedgerDecoder, LedgerEvents\n"
        "KVEventSubscriber('tcp://127.0.0.1:9', with_blocks=False).close()\n"
        "LedgerEvents('tcp://127.0.0.1:9').close()\n"
        "LedgerDecoder()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]", out.stdout
