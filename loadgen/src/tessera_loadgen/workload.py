"""The workload file: tenants, their arrival processes, request classes and SLOs.

A workload is user-facing configuration, so every model forbids unknown fields (a typo is an error, not a
silent default) and every field says what it means. ``load_workload(path)`` reads YAML; the CLI then
applies overrides such as ``--target`` or ``--key tenant=KEY``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessera_loadgen.arrivals import get_arrival_process
from tessera_loadgen.distributions import Constant, Distribution


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Slo(_Strict):
    """Service-level objectives; a request is *good* when it completes and meets every one that is set."""

    ttft_s: float | None = Field(None, gt=0, description="Time to first token limit, seconds.")
    tpot_s: float | None = Field(None, gt=0, description="Time per output token limit (after the first), s.")
    e2el_s: float | None = Field(None, gt=0, description="End-to-end latency limit, seconds.")
    view: Literal["user", "service"] = Field(
        "user",
        description="Judge TTFT and E2EL from the intended send time (user, includes client lateness) "
        "or from the actual send time (service).",
    )
    attainment_target: float = Field(
        0.99, gt=0, le=1, description="Share of requests that must be good for the SLO to be met (sweep)."
    )


class Arrival(_Strict):
    """An open-loop arrival process (see ``arrivals.py`` for the registered names)."""

    process: str = Field("poisson", description="Registered process name: poisson, gamma or constant.")
    rate_rps: float = Field(..., gt=0, description="Mean arrival rate, requests (or sessions) per second.")
    burstiness: float | None = Field(
        None, gt=0, description="Gamma shape: < 1 bursty, 1 Poisson, > 1 regular. Only for 'gamma'."
    )
    period_s: float | None = Field(
        None, gt=0, description="Repeat the first period_s seconds of arrivals every period_s seconds (the "
        "same offsets each period), so periods of a long run can be compared with each other; none: no repeat.",
    )

    @field_validator("process")
    @classmethod
    def _known_process(cls, name: str) -> str:
        get_arrival_process(name)
        return name

    @model_validator(mode="after")
    def _burstiness_only_for_gamma(self) -> Arrival:
        if self.burstiness is not None and self.process != "gamma":
            raise ValueError(f"burstiness applies to the 'gamma' process only, not {self.process!r}")
        return self


class Prompt(_Strict):
    """Where prompt text comes from and how long it is."""

    source: Literal["synthetic", "sharegpt"] = Field(
        "synthetic",
        description="Synthetic word sequences, or conversations from a ShareGPT-format JSON file.",
    )
    tokens: Distribution = Field(
        Constant(value=128),
        description="Synthetic prompt length in the model's tokens as the server counts them (chat template "
        "included; words when no tokenizer is known), not counting a shared prefix.",
    )
    path: str | None = Field(None, description="ShareGPT-format JSON file (source: sharegpt).")
    prefix_group: str | None = Field(
        None, description="Name of a workload prefix group; every prompt starts with one of its prefixes."
    )

    @model_validator(mode="after")
    def _path_for_sharegpt(self) -> Prompt:
        if self.source == "sharegpt" and not self.path:
            raise ValueError("prompt source 'sharegpt' needs a path")
        return self


class Session(_Strict):
    """Multi-turn chat: each turn waits for the previous answer, then a think time, then sends."""

    turns: Distribution = Field(..., description="Number of turns per session.")
    think_time_s: Distribution = Field(
        Constant(value=0), description="Pause between an answer and the next question, seconds."
    )


class RequestClass(_Strict):
    """One kind of request in a tenant's mix; metrics are also reported per class."""

    name: str = Field(..., min_length=1, description="Class name, used in results.")
    weight: float = Field(1.0, gt=0, description="Relative share of this class in the tenant's arrivals.")
    endpoint: Literal["chat", "completions"] = Field("chat", description="/v1/chat/completions or /v1/completions.")
    stream: bool = Field(True, description="Stream the response (SSE); needed for TTFT, TPOT and ITL.")
    prompt: Prompt = Field(default_factory=Prompt, description="Prompt source and length.")
    output_tokens: Distribution = Field(Constant(value=128), description="max_tokens of each request.")
    session: Session | None = Field(None, description="Make each arrival a multi-turn session (chat only).")
    slo: Slo | None = Field(None, description="SLO for this class; defaults to the tenant's.")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="Extra JSON fields for the body.")

    @model_validator(mode="after")
    def _session_is_chat(self) -> RequestClass:
        if self.session is not None and self.endpoint != "chat":
            raise ValueError(f"class {self.name!r}: multi-turn sessions need endpoint 'chat'")
        return self


class Tenant(_Strict):
    """A tenant of the platform: its own key, its own load, its own SLOs."""

    name: str = Field(..., min_length=1, description="Tenant name, used in results.")
    api_key: str | None = Field(None, description="API key sent as a Bearer token.")
    api_key_env: str | None = Field(None, description="Environment variable holding the API key.")
    model: str | None = Field(None, description="Model name; defaults to the workload's.")
    arrival: Arrival | None = Field(None, description="Open-loop arrivals (exclusive with concurrency).")
    concurrency: int | None = Field(
        None, ge=1, description="Closed loop: this many users, each sending when its last request ended."
    )
    max_connections: int | None = Field(
        None,
        ge=1,
        description="Cap on this tenant's open connections; requests beyond it wait in the client.",
    )
    slo: Slo | None = Field(None, description="SLO for this tenant's requests (classes may override).")
    classes: list[RequestClass] = Field(
        default_factory=lambda: [RequestClass(name="default")], min_length=1, description="The request mix."
    )
    extra_headers: dict[str, str] = Field(default_factory=dict, description="Extra HTTP headers.")

    @model_validator(mode="after")
    def _one_load_model(self) -> Tenant:
        if (self.arrival is None) == (self.concurrency is None):
            raise ValueError(f"tenant {self.name!r}: set exactly one of 'arrival' and 'concurrency'")
        names = [c.name for c in self.classes]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant {self.name!r}: duplicate class names {names}")
        return self

    def resolved_api_key(self) -> str | None:
        """``api_key``, else the value of ``api_key_env``; ``ValueError`` if that variable is unset."""
        if self.api_key is not None:
            return self.api_key
        if self.api_key_env is None:
            return None
        value = os.environ.get(self.api_key_env)
        if value is None:
            raise ValueError(f"tenant {self.name!r}: environment variable {self.api_key_env} is not set")
        return value

    def slo_for(self, request_class: RequestClass) -> Slo | None:
        """The SLO that applies to a class: its own, else the tenant's."""
        return request_class.slo if request_class.slo is not None else self.slo


class PrefixGroup(_Strict):
    """A set of shared prompt prefixes (system prompts, few-shot blocks), possibly shared across tenants."""

    num_prefixes: int = Field(1, ge=1, description="How many distinct prefixes the group has.")
    prefix_tokens: int = Field(
        ..., ge=1, description="Length of each prefix in the model's tokens (words when no tokenizer is known)."
    )


class RetryPolicy(_Strict):
    """What the client does with a 429."""

    on_429: Literal["respect", "count"] = Field(
        "respect",
        description="'respect': wait for Retry-After (else default_wait_s) and retry; "
        "'count': record the 429 and move on.",
    )
    max_retries: int = Field(3, ge=0, description="Retries per request before it counts as rejected.")
    default_wait_s: float = Field(1.0, ge=0, description="Wait when a 429 carries no Retry-After header.")
    max_wait_s: float = Field(60.0, ge=0, description="Upper bound on any single wait.")


class Workload(_Strict):
    """A complete load test: several tenants at once, limits, warm-up."""

    name: str = Field("workload", description="Name, used for the run directory.")
    description: str = Field("", description="Free text.")
    target: str | None = Field(None, description="Server root URL; the CLI's --target overrides it.")
    model: str | None = Field(None, description="Default model; if unset, the first of GET /v1/models.")
    seed: int = Field(0, description="Seed of every random choice; the same seed gives the same schedule.")
    duration_s: float | None = Field(None, gt=0, description="Measured duration (after warm-up), seconds.")
    num_requests: int | None = Field(None, ge=1, description="Measured requests to send (after warm-up).")
    warmup_s: float = Field(0.0, ge=0, description="Requests scheduled in the first seconds are warm-up.")
    warmup_requests: int = Field(0, ge=0, description="The first N arrivals are warm-up.")
    request_timeout_s: float = Field(300.0, gt=0, description="Per request, from first send, retries included.")
    continuous_usage_stats: bool = Field(
        True,
        description="Ask for usage in every chunk (vLLM), so multi-token chunks are counted exactly.",
    )
    ignore_eos: bool = Field(False, description="Send ignore_eos (vLLM) so outputs reach max_tokens.")
    retry: RetryPolicy = Field(default_factory=RetryPolicy, description="Client policy for 429 responses.")
    prefix_groups: dict[str, PrefixGroup] = Field(default_factory=dict, description="Named prefix groups.")
    tenants: list[Tenant] = Field(..., min_length=1, description="The tenants, all running at once.")

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        if self.duration_s is None and self.num_requests is None:
            raise ValueError("set duration_s or num_requests (or both)")
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate tenant names {names}")
        for tenant in self.tenants:
            for request_class in tenant.classes:
                group = request_class.prompt.prefix_group
                if group is not None and group not in self.prefix_groups:
                    raise ValueError(
                        f"tenant {tenant.name!r} class {request_class.name!r}: unknown prefix group "
                        f"{group!r}; defined: {sorted(self.prefix_groups)}"
                    )
        return self

    def tenant(self, name: str) -> Tenant:
        """The tenant called ``name``; ``ValueError`` listing the tenants otherwise."""
        for tenant in self.tenants:
            if tenant.name == name:
                return tenant
        raise ValueError(f"no tenant {name!r}; tenants: {[t.name for t in self.tenants]}")

    def open_loop_rate_rps(self) -> float:
        """Sum of the open-loop tenants' arrival rates."""
        return sum(t.arrival.rate_rps for t in self.tenants if t.arrival is not None)

    def with_total_rate(self, total_rps: float) -> Workload:
        """A copy whose open-loop tenants' rates are scaled to sum to ``total_rps``, keeping their mix."""
        current = self.open_loop_rate_rps()
        if current <= 0:
            raise ValueError("the workload has no open-loop tenant whose rate could be scaled")
        factor = total_rps / current
        tenants = [
            t
            if t.arrival is None
            else t.model_copy(
                update={"arrival": t.arrival.model_copy(update={"rate_rps": t.arrival.rate_rps * factor})}
            )
            for t in self.tenants
        ]
        return self.model_copy(update={"tenants": tenants})

    def with_keys(self, keys: dict[str, str]) -> Workload:
        """A copy with API keys set for the named tenants (``--key tenant=KEY``)."""
        for name in keys:
            self.tenant(name)
        tenants = [t.model_copy(update={"api_key": keys[t.name]}) if t.name in keys else t for t in self.tenants]
        return self.model_copy(update={"tenants": tenants})

    def redacted(self) -> dict[str, Any]:
        """The workload as JSON-ready data with API keys hidden, for result files."""
        data = self.model_dump(mode="json")
        for tenant in data["tenants"]:
            if tenant.get("api_key"):
                tenant["api_key"] = "***"
        return data


def load_workload(path: str | Path) -> Workload:
    """Read and validate a YAML workload file; relative ShareGPT paths resolve against the file's folder."""
    path = Path(path)
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: a workload file must be a mapping, got {type(raw).__name__}")
    workload = Workload.model_validate(raw)
    return _resolve_paths(workload, path.parent)


def _resolve_paths(workload: Workload, base: Path) -> Workload:
    tenants = []
    for tenant in workload.tenants:
        classes = []
        for request_class in tenant.classes:
            prompt = request_class.prompt
            if prompt.path is not None and not Path(prompt.path).is_absolute():
                prompt = prompt.model_copy(update={"path": str(base / prompt.path)})
            classes.append(request_class.model_copy(update={"prompt": prompt}))
        tenants.append(tenant.model_copy(update={"classes": classes}))
    return workload.model_copy(update={"tenants": tenants})
