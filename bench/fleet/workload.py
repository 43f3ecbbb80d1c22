"""The fleet benchmark's workload: one seeded request sequence that every policy replays, and the hit rate an
ideal cache would reach on it. Pure: no I/O, no clock.

Three kinds of traffic, mixed by arrival time:
* **chat sessions** — a tenant's system prompt (Zipf popularity over that tenant's prompts), then turns:
  each turn's prompt is the system prompt, the whole conversation so far, and a new user message. The
  assistant replies in the history are the workload's own text, not what the engine generated, so the
  sequence never depends on a response (every policy sees exactly the same prompts). Turns follow each
  other after an exponential think time, open loop.
* **single requests** — a session of one turn (most of a Zipf tail is this).
* **a noisy tenant** — long prompts that share nothing, at a share of the rate: load without reuse.

Prompts are ASCII text; the simulated engine's OpenAI routes tokenize one token per byte, so the Tessera
path sends ``list(text.encode())`` as token ids and a router in front of the OpenAI API sends the text:
both reach the engine as the same tokens, the same blocks, the same hashes.

The ideal (``ideal_cached_tokens``): one unbounded prefix cache that has seen every earlier request — the
longest prefix of a request's block chain some earlier request held, capped as vLLM caps a hit (the last
prompt token is always computed). Concurrency is ignored (a request arriving while its prefix is still
being prefilled elsewhere counts as a hit), so the ideal is an upper bound no router reaches exactly.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The ideal cache is the routing benches' shared figure (bench/routing_figures.py); bench_fleet takes it from here.
from routing_figures import ideal_cached_tokens as ideal_cached_tokens

NOISY_TENANT = "tenant-noisy"
_ALPHABET = string.ascii_lowercase + "      "  # spaces: word-like text, still one byte a character


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """The workload's shape. Token counts are bytes of ASCII text (one token a byte at the engine)."""

    num_requests: int
    rate_per_s: float  # all arrivals together, per simulated second
    seed: int = 17
    num_tenants: int = 8
    num_system_prompts: int = 64  # over all tenants (not counting the noisy one)
    zipf_s: float = 1.1
    system_tokens: tuple[int, int] = (1024, 3072)
    user_tokens: tuple[int, int] = (32, 256)
    reply_tokens: tuple[int, int] = (64, 320)
    max_turns: int = 6
    think_s: float = 3.0  # mean simulated seconds between a session's turns
    noisy_share: float = 0.15
    noisy_tokens: tuple[int, int] = (2048, 4096)
    max_tokens: int = 16
    max_prompt_tokens: int = 7000  # a session ends before its prompt would pass this
    gateway_workers: int = 2

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.rate_per_s <= 0:
            raise ValueError("a workload needs num_requests >= 1 and rate_per_s > 0")
        if not 0.0 <= self.noisy_share < 1.0:
            raise ValueError(f"noisy_share must be in [0, 1), got {self.noisy_share}")
        if self.num_tenants < 1 or self.num_system_prompts < self.num_tenants:
            raise ValueError("need num_tenants >= 1 and at least one system prompt per tenant")
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")


@dataclass(frozen=True, slots=True)
class FleetRequest:
    index: int
    arrival_s: float  # simulated seconds from the start
    tenant: str
    session_id: str | None  # the chat session (None: the noisy tenant's one-offs)
    turn: int
    text: str  # the prompt; its tokens are its bytes
    max_tokens: int
    worker: int  # which of the gateway workers routes it (Tessera's policies)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.text)

    def token_ids(self) -> list[int]:
        return list(self.text.encode())


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity of the ``n`` items by rank: ``1 / rank**s``, normalized."""
    raw = [1.0 / (rank ** s) for rank in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def _text(rng: random.Random, bounds: tuple[int, int]) -> str:
    return "".join(rng.choices(_ALPHABET, k=rng.randint(*bounds)))


def make_workload(config: WorkloadConfig) -> list[FleetRequest]:
    """The sequence, ordered by arrival, exactly ``config.num_requests`` long, ``noisy_share`` of it the noisy
    tenant's. Its span is about ``num_requests / rate_per_s`` (sessions cut short by ``max_prompt_tokens``
    make it longer)."""
    rng = random.Random(config.seed)
    # System prompts dealt round the tenants; each tenant's popularity is its own Zipf over its prompts.
    prompts: dict[int, list[str]] = {t: [] for t in range(config.num_tenants)}
    for i in range(config.num_system_prompts):
        prompts[i % config.num_tenants].append(f"System {i}: " + _text(rng, config.system_tokens))
    weights = {t: zipf_weights(len(p), config.zipf_s) for t, p in prompts.items()}
    # Tenants are Zipf too (s = 1): a few big ones, a tail of small ones.
    tenant_weights = zipf_weights(config.num_tenants, 1.0)

    # Sessions start as a Poisson process; each adds its turns. Generated until the first ``num_sessions``
    # arrivals are settled (a session starting later only adds later arrivals), then cut there.
    num_noisy = round(config.num_requests * config.noisy_share)
    num_sessions = config.num_requests - num_noisy
    mean_turns = (1 + config.max_turns) / 2
    session_rate = config.rate_per_s * (1 - config.noisy_share) / mean_turns
    drafts: list[tuple[float, str, str | None, int, str]] = []
    clock, session_no = 0.0, 0
    while num_sessions > 0:
        clock += rng.expovariate(session_rate)
        if session_no % 64 == 0 and len(drafts) >= num_sessions and \
                sorted(d[0] for d in drafts)[num_sessions - 1] < clock:
            break
        tenant = rng.choices(range(config.num_tenants), tenant_weights)[0]
        prompt_no = rng.choices(range(len(prompts[tenant])), weights[tenant])[0]
        session_id = f"tenant-{tenant}/session-{session_no}"
        session_no += 1
        history, at = prompts[tenant][prompt_no], clock
        for turn in range(rng.randint(1, config.max_turns)):
            history += "\nUser: " + _text(rng, config.user_tokens)
            if len(history) > config.max_prompt_tokens:
                break
            drafts.append((at, f"tenant-{tenant}", session_id, turn, history))
            history += "\nAssistant: " + _text(rng, config.reply_tokens)
            at += rng.expovariate(1.0 / config.think_s)
    drafts.sort(key=lambda d: d[0])
    drafts = drafts[:num_sessions]
    # The noisy tenant's arrivals: a Poisson process over the same span, given its count (uniform times).
    end_s = drafts[-1][0] if drafts else config.num_requests / config.rate_per_s
    for _ in range(num_noisy):
        drafts.append((rng.uniform(0.0, end_s), NOISY_TENANT, None, 0, "Noise: " + _text(rng, config.noisy_tokens)))
    drafts.sort(key=lambda d: d[0])
    return [FleetRequest(index=i, arrival_s=at, tenant=tenant, session_id=session_id, turn=turn, text=text,
                         max_tokens=config.max_tokens, worker=rng.randrange(config.gateway_workers))
            for i, (at, tenant, session_id, turn, text) in enumerate(drafts[:config.num_requests])]


def block_chains(requests: Sequence[FleetRequest], block_size: int,
                 chain_of: Callable[[list[int], int, str | None], tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Each request's block-hash chain by ``chain_of`` (``routing.hashing.block_hash_chain``), unsalted: the
    bench shares one cache namespace, as vLLM's router knows no salts. (About 1 ms a 5,000-token prompt.)"""
    cache: dict[str, tuple[int, ...]] = {}
    out = []
    for request in requests:
        chain = cache.get(request.text)
        if chain is None:
            chain = cache[request.text] = chain_of(request.token_ids(), block_size, None)
        out.append(chain)
    return out
