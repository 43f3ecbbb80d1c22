"""The pure part of engine capabilities: what runs of a config, given vLLM's answers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.engine.capabilities import (
    CapabilityError,
    Fallback,
    PlatformAnswers,
    kv_fallback_note,
    resolve,
)
from tessera.engine.config import EngineConfig
from tessera.engine.host import EngineConfigRefused, EngineStartError, start_error
from tessera.engine.root_cause import config_hint, last_exception_line, start_failure_line
from tessera.local.engine_failure import engine_failure_cause, engines_failed

FP8_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
DATA = Path(__file__).parent / "data"


def test_accepted_config_runs_as_written() -> None:
    config = EngineConfig(model="/m")
    resolution = resolve(config, PlatformAnswers())
    assert resolution.config is config and resolution.fallbacks == ()
    assert resolution.speculative_method == "ngram"


def test_refused_fp8_falls_back_to_auto_and_says_why() -> None:
    config = EngineConfig(model="/m", kv_scale_mode="dynamic")
    resolution = resolve(config, PlatformAnswers(kv_cache_dtype_refusal=FP8_REFUSAL))
    assert resolution.config.kv_cache_dtype == "auto"
    assert resolution.config.kv_scale_mode == "checkpoint"  # dynamic scales exist only for FP8
    assert resolution.config.to_vllm_kwargs()["kv_cache_dtype"] == "auto"
    assert resolution.config.speculative == config.speculative  # untouched
    (fallback,) = resolution.fallbacks
    assert (fallback.setting, fallback.requested, fallback.effective) == ("kvCacheDtype", "fp8", "auto")
    assert FP8_REFUSAL in fallback.describe() and "kvCacheDtypeStrict: true" in fallback.describe()
    assert resolution.fallback_for("kvCacheDtype") is fallback and resolution.fallback_for("x") is None


def test_strict_kv_dtype_raises_naming_the_cause_and_the_fix() -> None:
    config = EngineConfig(model="/m", kv_cache_dtype_strict=True)
    with pytest.raises(CapabilityError) as failure:
        resolve(config, PlatformAnswers(kv_cache_dtype_refusal=FP8_REFUSAL))
    message = str(failure.value)
    assert FP8_REFUSAL in message and "kvCacheDtype: auto" in message and "kvCacheDtypeStrict" in message


def test_a_refusal_of_what_was_not_asked_changes_nothing() -> None:
    config = EngineConfig(model="/m", kv_cache_dtype="auto", kv_cache_dtype_strict=True, speculative=None)
    resolution = resolve(config, PlatformAnswers(kv_cache_dtype_refusal=FP8_REFUSAL, speculative_refusal="no"))
    assert resolution.config is config and resolution.fallbacks == ()
    assert resolution.speculative_method == "none"


def test_refused_speculation_runs_without_it() -> None:
    config = EngineConfig(model="/m", speculative={"method": "eagle", "draft_model": "/draft"})
    resolution = resolve(config, PlatformAnswers(speculative_refusal="no draft at '/draft'"))
    assert resolution.config.speculative is None and "speculative_config" not in resolution.config.to_vllm_kwargs()
    assert resolution.speculative_method == "none"
    (fallback,) = resolution.fallbacks
    assert (fallback.setting, fallback.requested, fallback.effective) == ("speculative.method", "eagle", "none")


def test_strict_speculation_raises() -> None:
    config = EngineConfig(model="/m", speculative={"method": "mtp", "strict": True})
    with pytest.raises(CapabilityError, match=r"speculative\.strict is true"):
        resolve(config, PlatformAnswers(speculative_refusal="Unsupported speculative method: 'mtp'"))


def test_both_fallbacks_at_once() -> None:
    resolution = resolve(EngineConfig(model="/m"), PlatformAnswers(FP8_REFUSAL, "ngram is broken"))
    assert [f.setting for f in resolution.fallbacks] == ["kvCacheDtype", "speculative.method"]


def test_kv_note_states_the_capacity_cost() -> None:
    fallback = Fallback("kvCacheDtype", "fp8", "auto", FP8_REFUSAL, "Set kvCacheDtype: auto.")
    note = kv_fallback_note(fallback, "bfloat16", 2, num_blocks=1024, block_size=32, blocks_fixed=False)
    assert FP8_REFUSAL in note and "32,768 tokens (1,024 blocks of 32) in bfloat16" in note
    assert "fp8 would hold ~65,536" in note
    fixed = kv_fallback_note(fallback, "bfloat16", 2, num_blocks=64, block_size=32, blocks_fixed=True)
    assert "numGpuBlocksOverride" in fixed and "2x the bytes" in fixed


def test_root_cause_of_a_failed_ray_deployment_is_the_hosts_start_error() -> None:
    message = (DATA / "ray_deploy_failed.txt").read_text()
    cause = engine_failure_cause(message)
    assert cause.startswith("engine tessera-small-") and "speculative.strict is true" in cause
    assert "\n" not in cause and "Traceback" not in cause


def test_root_cause_falls_back_to_the_last_exception_line() -> None:
    message = ("The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n"
               '  File "x.py", line 1, in <module>\n'
               "ValueError: max_model_len=9999 is larger than the model's 2048\n"
               "RuntimeError: Deploying application tessera-engines failed: Failed to update the deployments\n")
    assert engine_failure_cause(message) == "ValueError: max_model_len=9999 is larger than the model's 2048"
    assert engine_failure_cause("") == "the engine deployment failed without a message"
    assert engine_failure_cause("just a line") == "just a line"


def test_start_failure_prefers_the_engine_process_cause_over_vllms_wrapper() -> None:
    wrapper = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
    child_log = ("(EngineCore pid=1) ERROR 12-01 [core.py:1510] RuntimeError: Worker failed with error 'x'\n"
                 "(Worker pid=2) ERROR 12-01 [multiproc_executor.py:1063] ValueError: max_model_len 9000 is "
                 "larger than the model's 2048\n")
    child = last_exception_line(child_log)
    assert child == "ValueError: max_model_len 9000 is larger than the model's 2048"
    assert start_failure_line(wrapper, child) == f"{child} [Tessera setting: maxModelLen]"
    assert start_failure_line(wrapper, None).startswith("RuntimeError: Engine core initialization failed")
    # An error of the host's own is already the cause.
    own = OSError("port 8000 is in use")
    assert start_failure_line(own, child) == "OSError: port 8000 is in use"
    refusal = CapabilityError("kvCacheDtype=fp8 is not available ... set kvCacheDtype: auto")
    assert start_failure_line(refusal, child) == str(refusal)
    assert config_hint("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.") is not None
    assert config_hint("something else entirely") is None


def test_a_refused_config_stops_tessera_up_at_the_first_failure_and_a_transient_one_waits_for_serve() -> None:
    """Serve retries a failing constructor; its message while it does (DEPLOYING) already holds the replica's
    error. A config the platform refuses fails every try alike: stop on it. Any other start failure may pass on a
    retry (a port taken, memory short for a moment): wait for Serve's verdict."""
    retrying = ("A replica failed to start with exception. Retrying 2 more time(s). Error:\n"
                "ray::ServeReplica:tessera-engines:engine-small.initialize_and_get_metadata() (pid=1)\n"
                '  File "host.py", line 160, in start\n')
    refused = ("tessera.engine.host.EngineConfigRefused: engine small-1 could not start: speculative.method=eagle "
               "cannot run here: no draft. speculative.strict is true, so the engine does not start")
    transient = "tessera.engine.host.EngineStartError: engine small-1 could not start: OSError: address in use"
    assert engines_failed("DEPLOYING", retrying + refused) == (
        "engine small-1 could not start: speculative.method=eagle cannot run here: no draft. speculative.strict "
        "is true, so the engine does not start")
    assert engines_failed("DEPLOYING", retrying + transient) is None
    assert engines_failed("DEPLOY_FAILED", retrying + transient) == (
        "engine small-1 could not start: OSError: address in use")
    assert engines_failed("RUNNING", "") is None


def test_the_host_marks_a_refused_config_and_only_that_as_refused() -> None:
    refused = start_error("small-1", CapabilityError("speculative.method=eagle cannot run here"), None)
    assert isinstance(refused, EngineConfigRefused)
    assert str(refused) == "engine small-1 could not start: speculative.method=eagle cannot run here"
    other = start_error("small-1", OSError("address in use"), None)
    assert isinstance(other, EngineStartError) and not isinstance(other, EngineConfigRefused)
