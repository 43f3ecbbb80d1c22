"""Turns a tenant's request classes into concrete requests: class choice, lengths, prompt, JSON body.

All randomness comes from one seeded ``random.Random`` per tenant and worker, so a run is reproducible.
The body is a plain dict; the client serialises it. Synthetic prompt content comes from the model's
``PromptMaker`` (in its tokens when its tokenizer is known), which also gives the asked prompt length
recorded as ``n_in_asked``.
"""

from __future__ import annotations

import bisect
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from tessera_loadgen.prompt_makers import PrefixText
from tessera_loadgen.prompts import Conversation, PromptLibrary
from tessera_loadgen.records import RequestRecord
from tessera_loadgen.workload import RequestClass, Tenant, Workload


@dataclass(slots=True)
class SessionState:
    """A multi-turn conversation in progress: the history the next turn sends."""

    session_id: str
    num_turns: int
    system: PrefixText | None
    conversation: Conversation | None
    messages: list[dict[str, str]] = field(default_factory=list)
    turn: int = 0


class RequestFactory:
    """Builds one tenant's requests."""

    def __init__(self, workload: Workload, tenant: Tenant, model: str, library: PromptLibrary, seed: int | str) -> None:
        self.workload = workload
        self.tenant = tenant
        self.model = model
        self.library = library
        self.prompts = library.maker(model)
        self.rng = random.Random(seed)
        self.classes = tenant.classes
        self._cum_weights = list(itertools.accumulate(c.weight for c in self.classes))
        self._stream_options: dict[str, Any] = {"include_usage": True}
        if workload.continuous_usage_stats:
            self._stream_options["continuous_usage_stats"] = True

    def pick_class(self) -> RequestClass:
        """A class drawn by weight."""
        if len(self.classes) == 1:
            return self.classes[0]
        x = self.rng.random() * self._cum_weights[-1]
        return self.classes[bisect.bisect_right(self._cum_weights, x)]

    def single(
        self, request_class: RequestClass, request_id: str, t_sched: float, warmup: bool
    ) -> tuple[RequestRecord, dict[str, Any]]:
        """A one-shot request of ``request_class`` scheduled at ``t_sched``."""
        rng = self.rng
        prompt_cfg = request_class.prompt
        prefix = self._prefix(request_class)
        chat = request_class.endpoint == "chat"
        messages = [{"role": "system", "content": prefix.text}] if chat and prefix is not None else []
        asked: int | None = None
        if prompt_cfg.source == "sharegpt":
            assert prompt_cfg.path is not None
            conversations = self.library.sharegpt(prompt_cfg.path)
            text = conversations[rng.randrange(len(conversations))].user_turns[0]
            if not chat and prefix is not None:
                text = f"{prefix.text}\n{text}"
        elif chat:
            prefix_tokens = 0 if prefix is None else prefix.num_tokens
            text, asked = self.prompts.chat_turn(rng, prompt_cfg.tokens.sample_int(rng), messages, prefix_tokens)
        else:
            text, asked = self.prompts.completion(rng, prompt_cfg.tokens.sample_int(rng), prefix)
        max_tokens = request_class.output_tokens.sample_int(rng)
        if chat:
            messages.append({"role": "user", "content": text})
            body = self._body(request_class, max_tokens, messages=messages)
        else:
            body = self._body(request_class, max_tokens, prompt=text)
        record = self._record(request_class, request_id, t_sched, warmup, max_tokens)
        record.n_in_asked = asked
        return record, body

    def new_session(self, request_class: RequestClass, session_id: str) -> SessionState:
        """Start a conversation; its turn count is drawn now (capped by a ShareGPT conversation's length)."""
        assert request_class.session is not None
        num_turns = request_class.session.turns.sample_int(self.rng)
        conversation = None
        if request_class.prompt.source == "sharegpt":
            assert request_class.prompt.path is not None
            conversations = self.library.sharegpt(request_class.prompt.path)
            conversation = conversations[self.rng.randrange(len(conversations))]
            num_turns = min(num_turns, len(conversation.user_turns))
        return SessionState(session_id, num_turns, self._prefix(request_class), conversation)

    def think_time_s(self, request_class: RequestClass) -> float:
        assert request_class.session is not None
        return max(0.0, request_class.session.think_time_s.sample(self.rng))

    def turn(
        self, request_class: RequestClass, session: SessionState, t_sched: float, warmup: bool
    ) -> tuple[RequestRecord, dict[str, Any]]:
        """The next turn of ``session``: the whole history so far plus a new user message."""
        rng = self.rng
        if not session.messages and session.system is not None:
            session.messages.append({"role": "system", "content": session.system.text})
        asked: int | None = None
        if session.conversation is not None:
            text = session.conversation.user_turns[session.turn]
        else:
            # The first turn is asked like a single request; later ones add their content to the history
            # the server will count (None: the maker measures it).
            history_tokens = None
            if session.turn == 0:
                history_tokens = 0 if session.system is None else session.system.num_tokens
            content_tokens = request_class.prompt.tokens.sample_int(rng)
            text, asked = self.prompts.chat_turn(rng, content_tokens, session.messages, history_tokens)
        session.messages.append({"role": "user", "content": text})
        max_tokens = request_class.output_tokens.sample_int(rng)
        body = self._body(request_class, max_tokens, messages=list(session.messages))
        record = self._record(request_class, f"{session.session_id}-t{session.turn}", t_sched, warmup, max_tokens)
        record.session_id = session.session_id
        record.turn = session.turn
        record.n_in_asked = asked
        return record, body

    @staticmethod
    def end_turn(session: SessionState, answer: str) -> None:
        """Append the assistant's answer so the next turn carries it."""
        session.messages.append({"role": "assistant", "content": answer})
        session.turn += 1

    # internals ------------------------------------------------------------------------------------------
    def _prefix(self, request_class: RequestClass) -> PrefixText | None:
        group = request_class.prompt.prefix_group
        return None if group is None else self.prompts.prefix(group, self.rng)

    def _body(self, request_class: RequestClass, max_tokens: int, **content: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, **content, "max_tokens": max_tokens}
        if request_class.stream:
            body["stream"] = True
            body["stream_options"] = self._stream_options
        if self.workload.ignore_eos:
            body["ignore_eos"] = True
        if request_class.extra_body:
            body.update(request_class.extra_body)
        return body

    def _record(
        self, request_class: RequestClass, request_id: str, t_sched: float, warmup: bool, max_tokens: int
    ) -> RequestRecord:
        return RequestRecord(
            request_id=request_id,
            tenant=self.tenant.name,
            request_class=request_class.name,
            endpoint=request_class.endpoint,
            stream=request_class.stream,
            t_sched=t_sched,
            warmup=warmup,
            max_tokens=max_tokens,
        )
