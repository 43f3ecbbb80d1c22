"""The one client every stack gets: streamed chat requests with ~350-token prompts that differ per request,
sent one after another (the sequential phase) or on a Poisson schedule (the rate phases).

Prompts are sized with the model's own tokenizer: random token ids, decoded, re-encoded and cut to
``PROMPT_TOKENS`` (the chat template adds a few more; the server's ``usage.prompt_tokens`` is reported).
Each prompt is seeded by (round, phase, index): every stack gets the same sequence, and no stack sees a
prompt twice, so the prefix cache never helps one request with another's prompt. Requests ask for
``ignore_eos`` so every stack generates exactly ``MAX_TOKENS`` tokens of the random-weight model.
TTFT is the first streamed event that carries generated text (vLLM sends a role-only event first).
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson

PROMPT_TOKENS = 350
MAX_TOKENS = 16
REQUEST_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Target:
    """Where a stack takes OpenAI chat requests."""

    base_url: str  # ends before /v1
    model: str
    api_key: str | None = None


@dataclass(frozen=True, slots=True)
class Phase:
    """``rate_rps`` None: ``num_requests`` sequential requests; else Poisson arrivals for ``duration_s``."""

    name: str
    num_requests: int = 0
    rate_rps: float | None = None
    duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class Sample:
    ok: bool
    ttft_s: float
    e2e_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    # Seconds from sending to each streamed event that carried generated text (bench_idle_gaps.py's decode time).
    text_arrivals_s: tuple[float, ...] = ()


class PromptMaker:
    """``PROMPT_TOKENS``-token texts in the model's vocabulary, one per seed."""

    def __init__(self, model_dir: Path, num_tokens: int = PROMPT_TOKENS) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        self.num_tokens = num_tokens
        special = {tok.content for tok in self.tokenizer.get_added_tokens_decoder().values() if tok.special}
        vocab = self.tokenizer.get_vocab()
        self._ids = sorted(i for t, i in vocab.items() if t not in special)

    def prompt(self, seed: str) -> str:
        rng = random.Random(seed)
        ids = [rng.choice(self._ids) for _ in range(self.num_tokens + 32)]
        text = self.tokenizer.decode(ids)
        again = self.tokenizer.encode(text, add_special_tokens=False).ids[: self.num_tokens]
        return str(self.tokenizer.decode(again))


def poisson_schedule(rate_rps: float, duration_s: float, seed: str) -> list[float]:
    """Arrival offsets (s) of a Poisson process at ``rate_rps`` within ``duration_s`` (pure, seeded)."""
    rng = random.Random(seed)
    times, t = [], rng.expovariate(rate_rps)
    while t < duration_s:
        times.append(t)
        t += rng.expovariate(rate_rps)
    return times


async def one_request(session: aiohttp.ClientSession, target: Target, prompt: str) -> Sample:
    body = {"model": target.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    headers = {"Content-Type": "application/json"}
    if target.api_key:
        headers["Authorization"] = f"Bearer {target.api_key}"
    t0 = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, int] = {}
    try:
        async with session.post(f"{target.base_url}/v1/chat/completions", data=orjson.dumps(body),
                                headers=headers) as resp:
            if resp.status != 200:
                return Sample(False, 0.0, time.perf_counter() - t0, error=f"{resp.status} {(await resp.text())[:200]}")
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                event = orjson.loads(line[6:])
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                    arrivals.append(time.perf_counter() - t0)
                if event.get("usage"):
                    usage = event["usage"]
    except (TimeoutError, aiohttp.ClientError) as exc:
        return Sample(False, 0.0, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}"[:200])
    e2e = time.perf_counter() - t0
    if not arrivals:
        return Sample(False, 0.0, e2e, error="stream carried no generated text")
    return Sample(True, arrivals[0], e2e, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)),
                  text_arrivals_s=tuple(arrivals))


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))


async def run_phase(target: Target, phase: Phase, prompts: list[str], offsets: list[float]) -> list[Sample]:
    """The phase's requests: one after another (``offsets`` empty) or each at its offset from the start."""
    async with client_session() as session:
        if phase.rate_rps is None:
            return [await one_request(session, target, prompt) for prompt in prompts]
        start = time.perf_counter()

        async def fire(at: float, prompt: str) -> Sample:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await one_request(session, target, prompt)

        return list(await asyncio.gather(*(fire(at, p) for at, p in zip(offsets, prompts, strict=True))))


def phase_requests(phase: Phase, maker: PromptMaker, round_index: int, stack: str) -> tuple[list[str], list[float]]:
    """The prompts and arrival offsets of one phase of one round of one stack: the same arrivals for every
    stack, prompts of their own. The vLLM-based stacks share one server, so a prompt an earlier stack sent
    would reach the next one's engine as a prefix-cache hit (the router's and the proxy's rows measured
    TTFTs of 11-30 ms against a cold vLLM's 33 ms that way)."""
    seed = f"{round_index}-{phase.name}"
    offsets = [] if phase.rate_rps is None else poisson_schedule(phase.rate_rps, phase.duration_s, seed)
    count = phase.num_requests if phase.rate_rps is None else len(offsets)
    return [maker.prompt(f"{stack}-{seed}-{i}") for i in range(count)], offsets


async def warm_up(target: Target, maker: PromptMaker, num_requests: int = 3) -> list[Sample]:
    """A few requests before measuring (connections, tokenizer and template caches); they must all succeed."""
    async with client_session() as session:
        return [await one_request(session, target, maker.prompt(f"warm-{i}")) for i in range(num_requests)]
