"""What of an ``EngineConfig`` this platform can run, decided before the model loads.

The config a user writes stays as written (``kvCacheDtype: fp8`` is the default because it halves KV bytes
on every GPU Tessera targets). At engine start the host asks vLLM, not a CPU-flag table of ours, whether
this platform can run the requested KV cache dtype and speculative method:

* ``ask_vllm`` (I/O) gets vLLM's answers: ``None`` where vLLM accepts a setting, vLLM's own refusal text
  where it does not;
* ``resolve`` (pure) turns the config and those answers into the config that runs, one ``Fallback`` per
  setting it had to change, or a ``CapabilityError`` where the config forbids the fallback
  (``kvCacheDtypeStrict``, ``speculative.strict``).

The fallbacks are what the replica reports: its registry entry, ``/stats``, ``/metrics``, the gateway's
``/v1/models`` and ``tessera up``'s banner all say what runs and why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from tessera.engine.config import EngineConfig

# What the KV cache falls back to: the model's own dtype (bf16 on every CPU and GPU Tessera targets).
FALLBACK_KV_CACHE_DTYPE = "auto"
NO_SPECULATION = "none"


class CapabilityError(ValueError):
    """The config asks for something this platform cannot run and forbids the fallback."""


@dataclass(frozen=True, slots=True)
class PlatformAnswers:
    """vLLM's answers for one config: ``None`` where it accepts a setting, its refusal text where not."""

    kv_cache_dtype_refusal: str | None = None
    speculative_refusal: str | None = None


@dataclass(frozen=True, slots=True)
class Fallback:
    """One setting that runs differently from what the config asks, and why."""

    setting: str  # the config key, as written in values files: kvCacheDtype, speculative.method
    requested: str
    effective: str
    reason: str  # vLLM's own words
    fix: str  # the config change that makes the choice explicit

    def describe(self) -> str:
        return (f"{self.setting}={self.requested} is not available on this platform ({self.reason}); "
                f"running with {self.setting}={self.effective}. {self.fix}")


@dataclass(frozen=True, slots=True)
class Resolution:
    """The config that runs, and what changed against the requested one."""

    config: EngineConfig
    fallbacks: tuple[Fallback, ...] = ()

    def fallback_for(self, setting: str) -> Fallback | None:
        return next((f for f in self.fallbacks if f.setting == setting), None)

    @property
    def speculative_method(self) -> str:
        return self.config.speculative.method if self.config.speculative is not None else NO_SPECULATION


def resolve(config: EngineConfig, answers: PlatformAnswers) -> Resolution:
    """The config this platform runs: a pure function of the requested config and vLLM's answers."""
    fallbacks: list[Fallback] = []
    update: dict[str, Any] = {}
    if answers.kv_cache_dtype_refusal is not None and config.kv_cache_dtype != FALLBACK_KV_CACHE_DTYPE:
        if config.kv_cache_dtype_strict:
            raise CapabilityError(
                f"kvCacheDtype={config.kv_cache_dtype} is not available on this platform: "
                f"{answers.kv_cache_dtype_refusal} kvCacheDtypeStrict is true, so the engine does not start; "
                f"set kvCacheDtype: {FALLBACK_KV_CACHE_DTYPE}, or kvCacheDtypeStrict: false to fall back to it.")
        fallbacks.append(Fallback(
            "kvCacheDtype", config.kv_cache_dtype, FALLBACK_KV_CACHE_DTYPE, answers.kv_cache_dtype_refusal,
            f"Set kvCacheDtype: {FALLBACK_KV_CACHE_DTYPE} to ask for this, or kvCacheDtypeStrict: true to "
            "refuse to start instead."))
        # Dynamic scales are an FP8 mode: without FP8 there is nothing to scale.
        update |= {"kv_cache_dtype": FALLBACK_KV_CACHE_DTYPE, "kv_scale_mode": "checkpoint"}
    speculative = config.speculative
    if answers.speculative_refusal is not None and speculative is not None:
        if speculative.strict:
            raise CapabilityError(
                f"speculative.method={speculative.method} cannot run here: {answers.speculative_refusal} "
                "speculative.strict is true, so the engine does not start; fix the method or its draft model, "
                "set speculative: null, or speculative.strict: false to run without speculation.")
        fallbacks.append(Fallback(
            "speculative.method", speculative.method, NO_SPECULATION, answers.speculative_refusal,
            "Set speculative: null to ask for this, or speculative.strict: true to refuse to start instead."))
        update["speculative"] = None
    effective = config.model_copy(update=update) if update else config
    return Resolution(effective, tuple(fallbacks))


def ask_vllm(config: EngineConfig) -> PlatformAnswers:
    """vLLM's answers for ``config`` on this process's platform; reads the model's config, loads no weights."""
    from vllm import AsyncEngineArgs

    model_config = AsyncEngineArgs(**probe_engine_kwargs(config)).create_model_config()
    return PlatformAnswers(
        kv_cache_dtype_refusal=kv_cache_dtype_refusal(
            config.vllm_kv_cache_dtype, model_config.dtype, model_config.get_head_size(),
            model_config.get_num_attention_heads(_parallel(config)), config.block_size),
        speculative_refusal=_speculative_refusal(config, model_config),
    )


def kv_cache_dtype_refusal(kv_cache_dtype: str, model_dtype: Any, head_size: int, num_heads: int,
                           block_size: int) -> str | None:
    """``None`` where vLLM's attention on this platform takes ``kv_cache_dtype``, else vLLM's reason."""
    from vllm.platforms import current_platform
    from vllm.utils.torch_utils import is_quantized_kv_cache
    from vllm.v1.attention.selector import AttentionSelectorConfig

    if not is_quantized_kv_cache(kv_cache_dtype):
        return None
    selector = AttentionSelectorConfig(head_size=head_size, dtype=model_dtype,
                                       kv_cache_dtype=cast(Any, kv_cache_dtype), block_size=block_size)
    try:
        # On GPUs the platform validates every attention backend against the KV dtype and raises when none fits.
        # No backend named (None), as vLLM's own selector calls it when the user chose none.
        current_platform.get_attn_backend_cls(None, selector, num_heads)  # type: ignore[arg-type]
        if current_platform.is_cpu():
            # NOTE: the CPU platform has one attention backend and picks it without looking at the KV dtype;
            # that backend chooses its kernel ISA (and refuses FP8 without AVX-512 or AMX) only when the
            # worker process builds the model's layers: too late to fall back. Ask the same function here.
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            _get_attn_isa(model_dtype, block_size, head_size, kv_cache_dtype)
    except (ValueError, NotImplementedError) as exc:
        return _one_line(exc)
    return None


def _speculative_refusal(config: EngineConfig, model_config: Any) -> str | None:
    if config.speculative is None:
        return None
    from vllm import AsyncEngineArgs

    # A fresh copy: vLLM writes the target model into the args' speculative dict.
    args = AsyncEngineArgs(**probe_engine_kwargs(config))
    try:
        args.create_speculative_config(model_config, _parallel(config))
    except (ValueError, NotImplementedError, OSError) as exc:  # pydantic's ValidationError is a ValueError
        return _one_line(exc)
    return None


def probe_engine_kwargs(config: EngineConfig) -> dict[str, Any]:
    """vLLM engine arguments for reading configs only (no weights, no engine)."""
    # No KV-event publisher: the probe builds configs only, and must not claim the replica's event port.
    return config.model_copy(update={"kv_events": config.kv_events.model_copy(update={"enabled": False})}
                             ).to_vllm_kwargs()


def _parallel(config: EngineConfig) -> Any:
    from vllm.config import ParallelConfig

    return ParallelConfig(tensor_parallel_size=config.tensor_parallel_size)


def _one_line(exc: BaseException) -> str:
    """vLLM's message without pydantic's preamble and help links: the first line that says something."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    useful = [line for line in lines if "validation error for" not in line and not line.startswith("For further")]
    text = (useful or lines or [type(exc).__name__])[0]
    return text.removeprefix("Value error, ")


def kv_fallback_note(fallback: Fallback, element: str, element_bytes: int, num_blocks: int, block_size: int,
                     blocks_fixed: bool) -> str:
    """The KV fallback's log line: why, and the capacity it costs against FP8's one byte per element."""
    tokens = num_blocks * block_size
    if blocks_fixed:
        cost = (f"the block count is fixed (numGpuBlocksOverride), so the {tokens:,} tokens of KV "
                f"({num_blocks:,} blocks of {block_size}) take {element_bytes}x the bytes")
    else:
        cost = (f"KV holds {tokens:,} tokens ({num_blocks:,} blocks of {block_size}) in {element}, "
                f"{element_bytes} bytes per element instead of 1: fp8 would hold ~{tokens * element_bytes:,}")
    return f"{fallback.describe()} Cost: {cost}."
