"""The engine host's configuration: one pydantic model, the single source of truth for the Helm chart,
the ``Model`` custom resource and ``make run``. ``to_vllm_kwargs`` is the only place it meets vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from tessera.engine.autoscaling import AutoscalingConfig
from tessera.engine.placement import (
    Accelerator,
    Placed,
    installed_vllm_build,
    model_in_engine_core,
    resolve_accelerator,
    vllm_executor_backend,
)

KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
SpeculativeMethod = Literal["ngram", "eagle", "eagle3", "draft_model", "mtp"]
# Methods that need a separate draft checkpoint; mtp and ngram draft from the target model itself.
DRAFT_MODEL_METHODS: frozenset[str] = frozenset({"eagle", "eagle3", "draft_model"})
# What a replica runs: vLLM, or the simulated engine (engine/sim/) for fleet-scale tests on Ray.
EngineBackend = Literal["vllm", "sim"]


class AdaptiveSpeculation(BaseModel):
    """Speculation that pays for itself: engine/speculation_policy.py states the rule and its break-even."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    enabled: bool = Field(
        default=True,
        description="Turn n-gram drafting down or off at run time where measured acceptance does not pay for "
        "the drafts, and back on when it does (other methods: advice in /stats only).",
    )
    interval_s: float = Field(default=2.0, gt=0.0, description="How often the controller decides, seconds.")
    window_requests: int = Field(default=256, ge=1, description="Finished requests per window (engine, tenant).")
    max_tenants: int = Field(default=64, ge=1, description="Tenants with a window of their own (least recent go).")
    min_decode_steps: int = Field(default=256, ge=1, description="Decode steps a window needs before a decision.")
    off_margin: float = Field(default=0.03, ge=0.0, lt=1.0, description="Off below a gain of 1 - offMargin.")
    on_margin: float = Field(default=0.03, ge=0.0, description="A probe turns it on at a gain of 1 + onMargin.")
    switch_margin: float = Field(default=0.05, ge=0.0, description="k changes only for a gain this much better.")
    probe_interval_s: float = Field(default=60.0, ge=0.0, description="While off, probe at full k after this long, s.")
    verify_cost_per_token: float = Field(
        default=0.1, ge=0.0, description="Cost of verifying one drafted token, relative to a decode step."
    )
    proposer_cost_per_step: float = Field(
        default=0.05, ge=0.0, description="The drafter's own cost per step, relative to a decode step."
    )


class SpeculativeConfig(BaseModel):
    """Speculative decoding settings (vLLM ``speculative_config``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    method: SpeculativeMethod = Field(default="ngram", description="Draft method.")
    num_speculative_tokens: int = Field(default=3, ge=1, le=16, description="Tokens drafted per step.")
    draft_model: str | None = Field(
        default=None, description="Draft checkpoint path (required for eagle, eagle3 and draft_model)."
    )
    prompt_lookup_min: int = Field(default=2, ge=1, description="n-gram: shortest n-gram matched in the context.")
    prompt_lookup_max: int = Field(default=4, ge=1, description="n-gram: longest n-gram matched in the context.")
    strict: bool = Field(
        default=False,
        description="Refuse to start where vLLM cannot run this method here (missing draft model, unsupported "
        "method or hardware). Default: run without speculation and report why.",
    )
    adaptive: AdaptiveSpeculation = Field(
        default_factory=AdaptiveSpeculation, description="Run-time speculation control (per engine)."
    )

    @model_validator(mode="after")
    def _draft_model_matches_method(self) -> SpeculativeConfig:
        if self.method in DRAFT_MODEL_METHODS and not self.draft_model:
            raise ValueError(f"speculative.method={self.method!r} needs speculative.draft_model (a checkpoint path)")
        if self.method not in DRAFT_MODEL_METHODS and self.draft_model:
            raise ValueError(
                f"speculative.draft_model is only used by {sorted(DRAFT_MODEL_METHODS)}, not {self.method!r}"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("speculative.prompt_lookup_min must be <= prompt_lookup_max")
        return self

    def to_vllm(self) -> dict[str, Any]:
        spec: dict[str, Any] = {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens}
        if self.method == "ngram":
            spec["prompt_lookup_min"] = self.prompt_lookup_min
            spec["prompt_lookup_max"] = self.prompt_lookup_max
        if self.draft_model:
            spec["model"] = self.draft_model
        return spec


class KVEventsSettings(BaseModel):
    """KV cache event publishing (vLLM ``KVEventsConfig``), consumed by the router's index and the controller."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    enabled: bool = Field(default=True, description="Publish BlockStored/BlockRemoved/AllBlocksCleared events.")
    endpoint: str = Field(
        default="tcp://127.0.0.1:*",
        description="ZMQ PUB bind address; port '*' picks a free port that the replica registers in Redis.",
    )
    topic: str = Field(default="kv", description="ZMQ topic prefix of published event batches.")


class SimulatedEngineSettings(BaseModel):
    """What only a simulated engine needs (``backend: sim``; engine/sim/serve_replica.py builds it).

    Everything a vLLM replica is also configured with comes from the ``EngineConfig`` itself: servedModelName,
    maxModelLen, blockSize, maxNumSeqs, maxNumBatchedTokens, enablePrefixCaching, schedulingPolicy, the KV
    block count (numGpuBlocksOverride, else the planner's capacity for gpu, modelPreset, tensorParallelSize
    and kvCacheDtype), the tokenizer the gateways read (tokenizer, else model), and Ray's placement."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)

    step_time: Literal["roofline", "measured"] = Field(
        default="roofline",
        description="How long a step takes: 'roofline' (the planner's bounds for gpu, modelPreset and "
        "tensorParallelSize) or 'measured' (stepS, perSeqS, perPrefillTokenS of a real engine).",
    )
    gpu: str = Field(default="h100-sxm", description="roofline: the planner's GPU preset.")
    model_preset: str = Field(default="llama-3-70b", description="roofline: the planner's model preset.")
    weight_dtype: Literal["bf16", "fp8", "int8", "int4"] = Field(
        default="bf16", description="roofline: the modelled weights' dtype."
    )
    compute_efficiency: float | None = Field(
        default=None, gt=0.0, le=1.0, description="roofline: share of peak FLOP/s reached (null: the sim's default)."
    )
    memory_efficiency: float | None = Field(
        default=None, gt=0.0, le=1.0, description="roofline: share of HBM bandwidth reached (null: the sim's default)."
    )
    step_overhead_s: float | None = Field(
        default=None, ge=0.0, description="roofline: fixed seconds per step (null: the sim's default)."
    )
    step_s: float | None = Field(default=None, ge=0.0, description="measured: seconds per one-sequence step.")
    per_seq_s: float | None = Field(default=None, ge=0.0, description="measured: seconds per extra sequence.")
    per_prefill_token_s: float | None = Field(
        default=None, ge=0.0, description="measured: seconds per prompt token computed."
    )
    time_scale: float = Field(
        default=1.0, gt=0.0,
        description="Wall-clock seconds per simulated second (10: ten times slower than real time); every "
        "latency the replica reports is simulated.",
    )
    enable_chunked_prefill: bool = Field(default=True, description="Split prompts over the step's token budget.")

    @model_validator(mode="after")
    def _step_time_fields(self) -> SimulatedEngineSettings:
        measured = {"stepS": self.step_s, "perSeqS": self.per_seq_s, "perPrefillTokenS": self.per_prefill_token_s}
        if self.step_time == "measured":
            missing = sorted(name for name, value in measured.items() if value is None)
            if missing:
                raise ValueError(f"sim.stepTime 'measured' needs {', '.join(missing)}")
        elif any(value is not None for value in measured.values()):
            raise ValueError(f"sim.{', sim.'.join(sorted(n for n, v in measured.items() if v is not None))} "
                             "only apply to stepTime 'measured'")
        return self


class EngineConfig(BaseModel):
    """One engine replica: a vLLM ``AsyncLLM`` plus the lean HTTP endpoint the gateway streams from."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, protected_namespaces=(), alias_generator=to_camel, populate_by_name=True
    )

    model: str = Field(
        description="Model directory (Hugging Face layout) or hub id; backend 'sim' reads only its tokenizer."
    )
    backend: EngineBackend = Field(
        default="vllm",
        description="What each replica runs: 'vllm' (the real engine) or 'sim' (a simulated engine, no vLLM: "
        "the same replica protocol, registry, heartbeat, KV events, index feed and Ray placement; settings in "
        "`sim`).",
    )
    sim: SimulatedEngineSettings | None = Field(
        default=None, description="The simulated engine's own settings (backend 'sim' only; null: defaults)."
    )
    served_model_name: str = Field(default="tessera-small", description="Name clients use in the `model` field.")
    tokenizer: str | None = Field(default=None, description="Tokenizer path; default: the model directory.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="Weight and activation dtype."
    )
    kv_cache_dtype: KVCacheDtype = Field(
        default="fp8", description="KV cache element type. fp8 halves KV bytes per token against bf16."
    )
    kv_cache_dtype_strict: bool = Field(
        default=False,
        description="Refuse to start where this platform cannot run kvCacheDtype (e.g. FP8 on a CPU without "
        "AVX-512 or AMX). Default: run with 'auto' (the model's dtype) and report why and what it costs.",
    )
    kv_scale_mode: Literal["checkpoint", "dynamic"] = Field(
        default="checkpoint",
        description="FP8 KV scales: 'checkpoint' uses the scales stored with the model (1.0 when absent); "
        "'dynamic' computes per-token-head scales at run time (vLLM's fp8_per_token_head).",
    )
    speculative: SpeculativeConfig | None = Field(
        default_factory=SpeculativeConfig, description="Speculative decoding; null turns it off."
    )
    enable_prefix_caching: bool = Field(default=True, description="Reuse KV blocks of identical prefixes.")
    scheduling_policy: Literal["priority", "fcfs"] = Field(
        default="priority", description="vLLM scheduler policy; 'priority' lets tenant priority classes act."
    )
    max_num_seqs: int = Field(default=64, ge=1, description="Most sequences scheduled at once.")
    max_model_len: int = Field(default=2048, ge=16, description="Context length (prompt + output), tokens.")
    max_num_batched_tokens: int | None = Field(default=None, ge=16, description="Token budget per step.")
    block_size: int = Field(default=32, ge=1, description="KV block size in tokens (a multiple of 32 on CPU).")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0.0, le=1.0, description="Share of accelerator memory vLLM may use."
    )
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per replica (tensor parallel).")
    accelerator: Accelerator = Field(
        default="auto",
        description="What a replica runs on and asks Ray for: 'gpu', tensorParallelSize GPUs on one node (one: "
        "the replica's own; more: a STRICT_PACK placement group of one-GPU bundles for vLLM's Ray executor); "
        "'cpu', no GPU (vLLM's CPU build); 'auto', what the installed vLLM build runs on (CPU build: cpu, "
        "otherwise gpu).",
    )
    num_gpu_blocks_override: int | None = Field(
        default=None, ge=1, description="Explicit KV block count (tests provoke eviction with a tiny cache)."
    )
    cpu_kv_cache_space_gib: int = Field(
        default=1, ge=1, description="KV cache size on the CPU build (VLLM_CPU_KVCACHE_SPACE), whole GiB."
    )
    enforce_eager: bool = Field(default=True, description="Skip graph capture (fast start-up).")
    seed: int = Field(default=0, description="Sampling seed of the engine.")
    kv_events: KVEventsSettings = Field(default_factory=KVEventsSettings, description="KV event publisher.")
    http_host: str | None = Field(
        default=None,
        description="Bind address of the replica's streaming endpoint and KV-event publisher; null: the address "
        "it registers (TESSERA_ADVERTISE_HOST: the pod IP in the chart, 127.0.0.1 locally), never every interface.",
    )
    http_port: int = Field(default=0, ge=0, le=65535, description="Port of the endpoint; 0 picks a free one.")
    heartbeat_interval_s: float = Field(default=1.0, gt=0.0, description="Registry heartbeat period, seconds.")
    max_body_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024,
        description="Largest request body the replica's endpoint accepts, bytes; a larger one is refused with 413.",
    )
    autoscaling: AutoscalingConfig | None = Field(
        default=None,
        description="Serve autoscaling of this model's replicas on a load signal the replicas report (null: a "
        "fixed replica count). Exclusive with the application's fixed `replicas` (docs/kubernetes.md).",
    )
    drain_timeout_s: float = Field(
        default=60.0, ge=0.0,
        description="How long a replica being removed (scale-down, redeploy) keeps serving its open streams "
        "after it left the registry, seconds; a stream still open then is cut. Serve kills the replica 15 s "
        "after this (graceful_shutdown_timeout_s).",
    )
    shm_busy_loop_s: float | None = Field(
        default=None, ge=0.0, le=1.0,
        description="How long vLLM's engine-core and worker processes busy-wait (sched_yield) on their shared-"
        "memory queues after each message before they sleep on a socket, seconds. vLLM's own value, 1.0, keeps "
        "each process on a core while a request runs and for a second after; 0 frees those cores for about a "
        "third of the CPU per request and costs some latency (docs/performance.md). Default (null): 0 on the "
        "CPU build, where the model's own threads need those cores; 1.0 with GPUs; under `tessera up`, a CPU "
        "engine pinned to cores of its own gets 0.01 (a short spin that the pinned cores can afford). A CPU "
        "engine that runs its model in the engine core (cpuModelInEngineCore) has no such queues.",
    )
    cpu_model_in_engine_core: bool = Field(
        default=True,
        description="On vLLM's CPU build with tensorParallelSize 1: run the model inside vLLM's engine-core "
        "process, as vLLM does with one GPU, instead of in a worker process of its own (the CPU build's "
        "default). Each step then skips two inter-process hand-overs: on a 2-vCPU machine a 16-token request "
        "took 57 instead of 97 ms at the replica (docs/performance.md section 1a). false: vLLM's own layout.",
    )

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.sim is not None and self.backend != "sim":
            raise ValueError(f"sim settings apply to backend 'sim' only, not {self.backend!r}")
        if (self.backend == "sim" and self.sim is not None and self.sim.step_time == "measured"
                and self.num_gpu_blocks_override is None):
            raise ValueError("backend 'sim' with sim.stepTime 'measured' needs numGpuBlocksOverride (the planner "
                             "sizes the KV cache only for the roofline model)")
        if self.kv_scale_mode == "dynamic" and self.kv_cache_dtype not in ("fp8", "fp8_e4m3"):
            raise ValueError(
                f"kv_scale_mode='dynamic' needs kv_cache_dtype 'fp8' or 'fp8_e4m3', not {self.kv_cache_dtype!r}"
            )
        if self.num_gpu_blocks_override is not None:
            capacity = self.num_gpu_blocks_override * self.block_size
            if self.max_model_len > capacity:
                raise ValueError(
                    f"max_model_len={self.max_model_len} exceeds the KV capacity of num_gpu_blocks_override="
                    f"{self.num_gpu_blocks_override} blocks x block_size={self.block_size} = {capacity} tokens"
                )
        return self

    @property
    def vllm_kv_cache_dtype(self) -> str:
        # NOTE: vLLM 0.32 dropped calculate_kv_scales; dynamic scaling is a cache dtype of its own.
        if self.kv_scale_mode == "dynamic":
            return "fp8_per_token_head"
        return self.kv_cache_dtype

    @property
    def sim_settings(self) -> SimulatedEngineSettings:
        """The simulated engine's settings (backend 'sim'), defaults where the config gives none."""
        return self.sim or SimulatedEngineSettings()

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def placed_on(self) -> Placed:
        """What this config runs on where it is read: ``accelerator``, 'auto' resolved against the installed
        vLLM build (package metadata: no vLLM import)."""
        return resolve_accelerator(self.accelerator, installed_vllm_build())

    @property
    def runs_model_in_engine_core(self) -> bool:
        """``cpu_model_in_engine_core`` where it applies: the CPU build (as resolved here), one worker."""
        return model_in_engine_core(self.placed_on, self.tensor_parallel_size, self.cpu_model_in_engine_core)

    def validate_for_cpu(self) -> None:
        """The CPU build's own limits, checked before vLLM fails on them obscurely."""
        if self.block_size % 32:
            raise ValueError(f"block_size={self.block_size}: the CPU build of vLLM needs a multiple of 32")

    def to_vllm_kwargs(self, kv_events_endpoint: str | None = None) -> dict[str, Any]:
        """Keyword arguments for ``vllm.AsyncEngineArgs``."""
        kwargs: dict[str, Any] = {
            "model": self.model,
            "tokenizer": self.tokenizer_path,
            "served_model_name": self.served_model_name,
            "dtype": self.dtype,
            "kv_cache_dtype": self.vllm_kv_cache_dtype,
            "enable_prefix_caching": self.enable_prefix_caching,
            "scheduling_policy": self.scheduling_policy,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "tensor_parallel_size": self.tensor_parallel_size,
            "enforce_eager": self.enforce_eager,
            "seed": self.seed,
            "disable_log_stats": False,
        }
        backend = vllm_executor_backend(self.accelerator, self.tensor_parallel_size)
        if backend is not None:
            kwargs["distributed_executor_backend"] = backend
        if self.runs_model_in_engine_core:
            # With VLLM_ENABLE_V1_MULTIPROCESSING=0 in the environment (vllm_engine.prepare_environment).
            kwargs["distributed_executor_backend"] = "uni"
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.num_gpu_blocks_override is not None:
            kwargs["num_gpu_blocks_override"] = self.num_gpu_blocks_override
        if self.speculative is not None:
            kwargs["speculative_config"] = self.speculative.to_vllm()
            if self.speculative.adaptive.enabled and self.speculative.method == "ngram":
                # The run-time switch reaches the drafter in vLLM's worker through this extension.
                kwargs["worker_extension_cls"] = "tessera.engine.speculation_control.SpeculationWorkerExtension"
            # Per-request drafted/accepted counts on the final output (the engine span's spec attributes).
            kwargs["per_request_spec_decode_metrics"] = "summary"
        if self.kv_events.enabled:
            from vllm.config import KVEventsConfig

            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=kv_events_endpoint or self.kv_events.endpoint,
                topic=self.kv_events.topic,
            )
        return kwargs


def default_small_model_dir(state_dir: Path) -> Path:
    return state_dir / "models" / "tessera-small"
