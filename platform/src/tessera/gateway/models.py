"""The gateway's view of served models: tokenizers (loaded once per process) and context limits."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from tessera.gateway.fast_bpe import tiktoken_pieces
from tessera.gateway.segment_tokens import SegmentTokenizer
from tessera.redis_wire import RedisWire
from tessera.refresher import UsageRefresher
from tessera.registry import MODELS_HASH, EngineRecord, ModelInfo, list_models

# The defaults of ``ModelCatalog``'s ``refresh_s``/``max_age_s`` (the gateway passes its settings,
# ``TESSERA_CATALOG_REFRESH_S``/``TESSERA_CATALOG_MAX_AGE_S``, whose defaults these equal). Re-read in the
# background this often while requests come (models change on deploys, not per request; a model registered
# since the last read is read on its first request, see ``ModelCatalog.get``); older than the max age (the
# first request, a refresher that Redis stalls), a request re-reads it itself.
CATALOG_REFRESH_S = 5.0
CATALOG_MAX_AGE_S = 15.0
# How long a model record that failed to load waits before this gateway tries the same record again.
RETRY_UNLOADABLE_S = 30.0
# A request naming a model the copy lacks re-reads the catalog at once (a model registered since the last read is
# served on its first request), but at most once in this long, seconds: the name is checked before admission, so no
# tenant limit counts such requests, and each one re-read Redis (a tenant over its rate limit sending made-up names
# made the gateway read Redis as fast as it sent them). A model registered meanwhile waits at most this long.
MISS_REREAD_S = 1.0


# Prompts repeat (a client's fixed system prompt and question set, a benchmark's prompt, retries): the token
# ids of recent prompts are kept per model, so a repeated one skips the chat template and the tokenizer.
# Oldest out first. The bound is in tokens as well as entries: a cached id costs ~36 bytes (a list slot and
# an int object), so MAX_CACHED_TOKENS holds a worker's cache under ~2.5 MiB per model whatever tenants send.
# NOTE: bounded by entries alone (1,024 prompts of up to 16,384 characters), a tenant sending distinct long
# prompts grew each worker by up to ~150 MiB, and `make bench-soak` saw the gateway's RSS climb for 20 minutes
# of ordinary 200-token prompts before the cache filled.
MAX_CACHED_PROMPTS = 256
MAX_CACHED_TOKENS = 65_536
MAX_CACHED_PROMPT_CHARS = 16_384
# One prompt may take at most this share of the token budget, so a long one does not flush every short one.
MAX_CACHED_PROMPT_SHARE = 0.25
# How long loading a model waits for the tiktoken path's check (ServedModel.speed_up) before it serves on the
# tokenizer's own path and lets the check finish in its thread.
FAST_PATH_WAIT_S = 0.5

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ServedModel:
    info: ModelInfo
    tokenizer: Any  # tokenizers.Tokenizer
    chat_template: Any  # jinja2.Template (compiled once, at load) | None
    bos_token: str
    eos_token: str
    chat_template_text: str | None = None
    # prompt (a string, or the chat messages as ((role, content), ...)) -> its token ids; never mutated
    _encoded: dict[object, list[int]] = field(default_factory=dict, repr=False)
    _num_cached_tokens: int = field(default=0, repr=False)
    # A rendered conversation's pieces between special tokens, each tokenized once (None: the tokenizer's cut
    # is not one the gateway can repeat exactly; see segment_tokens.py).
    segments: SegmentTokenizer | None = field(default=None, repr=False)
    # A whole text's ids, computed each time: the tokenizer's own, or, once ``speed_up`` has shown it gives the same
    # ids, added tokens cut out and the pieces between them by tiktoken's merge loop (fast_bpe.py).
    _encode_text: Callable[[str], list[int]] | None = field(default=None, repr=False)
    fast_path: bool = field(default=False, repr=False)  # True once the tiktoken path is in use

    def __post_init__(self) -> None:
        reference = functools.partial(token_ids, self.tokenizer)
        if self.segments is None:
            self.segments = SegmentTokenizer.of(self.tokenizer, reference)
        self._encode_text = reference

    def speed_up(self, wait_s: float = FAST_PATH_WAIT_S) -> threading.Thread | None:
        """Checks, in a thread, whether tiktoken gives this tokenizer's ids (~1 s of merges to walk for a 50,000-
        token vocabulary, ~10 ms for the small model) and switches to it if so; waits up to ``wait_s`` for that,
        so a small tokenizer is fast from the first request and a large one delays its model by ``wait_s`` at most
        (``ModelCatalog`` loads models in a thread: the wait holds no event loop)."""
        if not hasattr(self.tokenizer, "to_str"):
            return None
        thread = threading.Thread(target=self._switch_to_fast_path, name=f"fast-bpe-{self.info.name}", daemon=True)
        thread.start()
        thread.join(wait_s)
        return thread

    def _switch_to_fast_path(self) -> None:
        added = added_tokens(self.tokenizer)
        try:
            fast = tiktoken_pieces(json.loads(self.tokenizer.to_str()), functools.partial(token_ids, self.tokenizer),
                                   added, self.info.name)
        except Exception:  # never worth a request: the tokenizer's own path stays
            logger.exception("model %s: the tiktoken path could not be built", self.info.name)
            return
        if fast is None:
            return
        if not added:
            self._encode_text = fast
        elif self.segments is not None:
            self.segments.use_piece_encoder(fast)
            self._encode_text = functools.partial(self.segments.encode, remember=False)
        else:
            return  # added tokens the gateway cannot cut as the tokenizer does (segment_tokens.py)
        self.fast_path = True

    def encode_text(self, text: str) -> list[int]:
        """``text``'s ids, computed every time (no cache), as ``token_ids`` gives them."""
        assert self._encode_text is not None
        return self._encode_text(text)

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (the caller must not change the list: it may be the cached one)."""
        ids = self._encoded.get(text)
        if ids is None:
            ids = self.encode_text(text)
            self._remember(text, len(text), ids)
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of the rendered conversation (not to be changed, as ``encode``'s)."""
        key = tuple((m["role"], m["content"]) for m in messages)
        ids = self._encoded.get(key)
        if ids is None:
            ids = self._encode_chat(messages)
            self._remember(key, sum(len(content) for _, content in key), ids)
        return ids

    def _remember(self, key: object, num_chars: int, ids: list[int]) -> None:
        if num_chars > MAX_CACHED_PROMPT_CHARS or len(ids) > MAX_CACHED_TOKENS * MAX_CACHED_PROMPT_SHARE:
            return
        while self._encoded and (len(self._encoded) >= MAX_CACHED_PROMPTS
                                 or self._num_cached_tokens + len(ids) > MAX_CACHED_TOKENS):
            self._num_cached_tokens -= len(self._encoded.pop(next(iter(self._encoded))))
        self._encoded[key] = ids
        self._num_cached_tokens += len(ids)

    def _encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        if self.chat_template is None:
            # No template shipped: a plain role-prefixed transcript, documented in the README.
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        else:
            text = self.chat_template.render(
                messages=messages, add_generation_prompt=True, bos_token=self.bos_token, eos_token=self.eos_token
            )
        # A lone message has no history for a later turn to reuse (and no shared system prompt): its pieces
        # would only fill the cache with text sent once, so it is encoded whole.
        if self.segments is None or len(messages) < 2:
            return self.encode_text(text)
        return self.segments.encode(text)


def added_tokens(tokenizer: Any) -> list[str]:
    """The contents of ``tokenizer``'s added tokens (none for an object without them)."""
    decoder = getattr(tokenizer, "get_added_tokens_decoder", None)
    return [token.content for token in decoder().values()] if decoder is not None else []


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """``text``'s token ids, no special tokens added. ``encode_batch_fast`` (tokenizers >= 0.20) skips the
    character offsets an ``Encoding`` otherwise tracks, which the gateway never reads: 190 against 250 us for a
    different 350-token prompt each time (the small model's BPE, an avx512 VM), the same ids. ``encode`` where
    the tokenizer has no such method."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    if fast is None:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    return list(fast([text], add_special_tokens=False)[0].ids)


def replicas_extension(records: list[EngineRecord]) -> dict[str, Any]:
    """The ``tessera`` extension field of a ``/v1/models`` entry: what each live replica of the model runs.

    The effective values, which differ from the config where the platform could not run it (the reasons are
    for operators: the replica's /stats, registry entry and logs). No engine ids or addresses: a tenant learns
    what it is served with, not where.
    """
    return {"replicas": [{"kv_cache_dtype": r.kv_cache_dtype, "kv_blocks": r.num_gpu_blocks,
                          "block_size": r.block_size, "kv_capacity_tokens": r.kv_capacity_tokens,
                          "speculative_method": r.speculative_method} for r in records]}


def tokenizer_document(served: ServedModel) -> dict[str, Any]:
    """``GET /v1/models/{model}/tokenizer``: the tokenizer as the gateway counts with it (tokenizer.json,
    embedded as is), its chat template and special tokens, and the context length."""
    import orjson

    return {"model": served.info.name, "max_model_len": served.info.max_model_len,
            "tokenizer": orjson.Fragment(served.tokenizer.to_str()), "chat_template": served.chat_template_text,
            "bos_token": served.bos_token, "eos_token": served.eos_token}


def load_served_model(info: ModelInfo) -> ServedModel:
    import jinja2
    from tokenizers import Tokenizer

    path = Path(info.tokenizer)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    config: dict[str, Any] = {}
    if (path / "tokenizer_config.json").exists():
        config = json.loads((path / "tokenizer_config.json").read_text())
    template_text = config.get("chat_template")
    if not template_text and (path / "chat_template.jinja").exists():
        template_text = (path / "chat_template.jinja").read_text()
    env = jinja2.Environment(autoescape=False, keep_trailing_newline=True)
    template = env.from_string(template_text) if isinstance(template_text, str) else None

    def token_text(value: Any) -> str:
        return value.get("content", "") if isinstance(value, dict) else str(value or "")

    served = ServedModel(info, tokenizer, template, token_text(config.get("bos_token")),
                         token_text(config.get("eos_token")),
                         template_text if isinstance(template_text, str) else None)
    served.speed_up()
    return served


class ModelCatalog:
    """Models registered by engines, re-read from Redis every ``refresh_s`` off the request path (over the
    lean connection ``wire`` when given)."""

    def __init__(self, redis: aioredis.Redis, *, refresh_s: float = CATALOG_REFRESH_S,
                 max_age_s: float = CATALOG_MAX_AGE_S, wire: RedisWire | None = None) -> None:
        self._redis = redis
        self._wire = wire
        self._models: dict[str, ServedModel] = {}
        # model -> the registered record that could not be loaded here (a tokenizer this gateway cannot read), why,
        # and when it was tried: that model is answered 503, every other model is served as before.
        self._unloadable: dict[str, tuple[ModelInfo, str, float]] = {}
        self._max_age_s = max_age_s
        self._refreshed_at = -max_age_s
        self._missed_at = -MISS_REREAD_S  # when a request last re-read the catalog for a name it lacked
        # One refresh at a time: a model's load now yields to the loop, and the refresher and a request's miss
        # would otherwise each load a newly registered model (a second tokenizer in memory, its CPU twice).
        self._refreshing = asyncio.Lock()
        self.refresher = UsageRefresher("model catalog", self.refresh, refresh_s)

    async def refresh(self) -> None:
        """Re-reads the catalog, unless a read that began after this call did meanwhile (requests that find the
        copy stale together wait for one read, not for one each in turn)."""
        asked_at = time.monotonic()
        async with self._refreshing:
            if self._refreshed_at < asked_at:
                await self._refresh()

    async def _refresh(self) -> None:
        started = time.monotonic()
        infos = await self._read()
        for info in infos:
            current = self._models.get(info.name)
            if (current is None or current.info != info) and not self._failed_lately(info, started):
                try:
                    # In a thread: reading a tokenizer file, compiling its template and waiting up to
                    # FAST_PATH_WAIT_S for the tiktoken check took the worker's event loop for as long (0.5 s and
                    # more for a 50,000-token vocabulary), and every stream the worker relayed stalled meanwhile.
                    self._models[info.name] = await asyncio.to_thread(load_served_model, info)
                except Exception as exc:  # any model's bad record must not take the others down
                    self._not_loaded(info, exc, started)
                else:
                    self._unloadable.pop(info.name, None)
        registered = {i.name for i in infos}
        for name in set(self._models) - registered:
            del self._models[name]
        for name in set(self._unloadable) - registered:
            del self._unloadable[name]
        self._refreshed_at = started

    def _failed_lately(self, info: ModelInfo, now: float) -> bool:
        """This very record failed to load within RETRY_UNLOADABLE_S: not tried again yet (a tokenizer that exists
        but will not load can cost a second of CPU a try; a changed record is tried at once)."""
        failed = self._unloadable.get(info.name)
        return failed is not None and failed[0] == info and now - failed[2] < RETRY_UNLOADABLE_S

    def _not_loaded(self, info: ModelInfo, exc: Exception, now: float) -> None:
        """A registered model this gateway cannot load, logged when the reason changes. A model already loaded from
        an earlier record keeps serving from it."""
        reason = f"tokenizer {info.tokenizer!r}: {exc}"
        failed = self._unloadable.get(info.name)
        if failed is None or failed[1] != reason:
            logger.error("model %s is registered but cannot be loaded here, %s", info.name, reason)
        self._unloadable[info.name] = (info, reason, now)

    def unavailable(self, name: str) -> str | None:
        """Why a registered model cannot be served here (None: it can, or it is not registered)."""
        failed = self._unloadable.get(name)
        return None if failed is None or name in self._models else failed[1]

    async def _current(self) -> None:
        self.refresher.used()
        if time.monotonic() - self._refreshed_at > self._max_age_s:
            await self.refresh()

    async def _read(self) -> list[ModelInfo]:
        if self._wire is None:
            return await list_models(self._redis)
        (flat,) = await self._wire.execute([("HGETALL", MODELS_HASH)])
        if isinstance(flat, Exception):
            raise flat
        return [ModelInfo(**json.loads(value)) for value in flat[1::2]]  # [field, value, field, value, ...]

    async def get(self, name: str) -> ServedModel | None:
        await self._current()
        if name not in self._models and name not in self._unloadable:
            # A model registered since the last read (a broken one waits for the refresher); at most one such
            # re-read in MISS_REREAD_S, however many requests name models nobody serves.
            now = time.monotonic()
            if now - self._missed_at >= MISS_REREAD_S:
                self._missed_at = now
                await self.refresh()
        return self._models.get(name)

    async def names(self) -> list[str]:
        await self._current()
        return sorted(self._models)

    async def close(self) -> None:
        await self.refresher.close()
