"""The simulated engine's configuration: what a replica of the modelled engine would be configured with,
plus the step-time model and the time scale."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tessera.engine.sim.step_time import RooflineStepTime, StepTimeConfig, roofline_num_gpu_blocks


class SimEngineConfig(BaseModel):
    """One simulated replica (every engine of a ``tessera engine sim`` fleet shares it)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str = Field(default="sim-llama-3-70b", min_length=1,
                                   description="Model name the replica registers and serves.")
    tokenizer: str = Field(default="", description=(
        "Tokenizer the gateways tokenize this model's prompts with (the registry's model record); the sim "
        "itself never tokenizes gateway traffic."))
    max_model_len: int = Field(default=8192, ge=2, description="Prompt plus output tokens per request.")
    block_size: int = Field(default=16, ge=1, description="Tokens per KV block.")
    num_gpu_blocks: int | None = Field(default=None, ge=2, description=(
        "KV blocks including vLLM's null block; unset: the planner's capacity for the roofline model's "
        "GPU, model and TP (required with the measured model)."))
    max_num_seqs: int = Field(default=256, ge=1, description="Sequences per step (vLLM's max_num_seqs).")
    max_num_batched_tokens: int = Field(default=8192, ge=1, description="Tokens per step (the token budget).")
    enable_chunked_prefill: bool = Field(default=True, description="Split prompts over the token budget.")
    long_prefill_token_threshold: int = Field(default=0, ge=0, description=(
        "vLLM's cap on the tokens one prefill takes a step while other requests run or wait (0: none, vLLM's "
        "default)."))
    enable_prefix_caching: bool = Field(default=True, description="Reuse cached full blocks (and announce them).")
    scheduling_policy: Literal["fcfs", "priority"] = Field(default="fcfs", description="vLLM's scheduling policy.")
    step_time: StepTimeConfig = Field(default_factory=RooflineStepTime,
                                      description="How long a step takes: `roofline` or `measured`.")
    time_scale: float = Field(default=1.0, gt=0.0, description=(
        "Wall-clock seconds per simulated second: 10 runs the fleet ten times slower than real time, so a "
        "busy process keeps up. Every latency the sim reports is in simulated seconds."))
    timer_slack_s: float = Field(default=0.005, ge=0.0, description=(
        "Wall seconds the event loop may wake late (timer resolution, a busy loop) at a step's end while the "
        "next step still starts at that end in simulated time, so modelled step times hold exactly; a "
        "lateness beyond it is lag, and shows as latency."))
    frontend_delays_s: tuple[float, ...] = Field(default=(), description=(
        "Simulated seconds from a request's arrival at the replica to its arrival at the scheduler (a real "
        "engine's input processing and the hop to its engine core), drawn per request from these measured "
        "values (empty: none). TTFT and E2E count it; the engine's own queue time does not."))
    frontend_seed: int = Field(default=0, description="Seed of the frontend-delay draws.")
    http_host: str = Field(default="127.0.0.1", description="Address the replicas' HTTP servers bind.")
    advertise_host: str = Field(default="127.0.0.1", description="Host in the URLs the replicas register.")
    heartbeat_interval_s: float = Field(default=1.0, gt=0.0, description="Registry heartbeat period (wall s).")
    feed_index: bool = Field(default=True, description=(
        "Feed the Redis prefix index from each replica's KV events, as a real replica's host does."))
    vocab_size: int = Field(default=32000, ge=2, description="Sampled token ids lie in [0, vocab_size).")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="Largest request body (413 over).")

    @field_validator("frontend_delays_s")
    @classmethod
    def _non_negative(cls, delays: tuple[float, ...]) -> tuple[float, ...]:
        if any(d < 0 for d in delays):
            raise ValueError("frontend_delays_s must be >= 0")
        return delays

    @model_validator(mode="after")
    def _blocks_known(self) -> SimEngineConfig:
        if self.num_gpu_blocks is None and self.step_time.kind != "roofline":
            raise ValueError("num_gpu_blocks is required unless step_time is the roofline model")
        return self

    def resolved_num_gpu_blocks(self) -> int:
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        assert isinstance(self.step_time, RooflineStepTime)
        return roofline_num_gpu_blocks(self.step_time, self.block_size, self.max_model_len)
