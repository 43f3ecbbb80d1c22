"""The stacks under test, each started by the bench on the same generated model, in this session (each in
its own process group, never a new session: with the kernel's autogroup scheduling a session is a
scheduling group, and helpers alone in one starve beside vLLM's busy threads on a 2-core machine).

* ``vllm``: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with the engine
  settings Tessera's engine resolves to here (``resolved_engine``): the baseline;
* ``vllm+router``: the same server behind vLLM's Rust router (``vllm-router``, bench-only venv);
* ``vllm+litellm``: the same server behind the LiteLLM proxy (master key, no database; bench-only venv);
* ``tessera``: ``tessera up`` as a user runs it (one engine, its default gateway workers and controller),
  with a tenant created by ``tessera tenants create``.

A ``Running`` stack says where to send requests, which process trees are which part (see cpu.py) and what
it runs with.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _support import stopped_if_start_fails

from tessera.engine.ports import free_port

from .workload import Target

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STACK_VENV = REPO / ".venv-bench-stack"
MODEL_NAME = "tessera-small"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
LITELLM_KEY = "sk-bench-stack"
START_TIMEOUT_S = 600.0
# The environment `tessera up` gives its engines (local/platform.py), given to the baseline server too.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
              "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}


class StackUnavailable(RuntimeError):
    """A stack that cannot be installed or started here; the message says why, and its row is skipped."""


@dataclass
class Running:
    name: str
    target: Target
    roots: dict[int, str]  # root pid -> part of its process tree (cpu.py)
    ran_with: dict[str, Any]
    stop: Callable[[], None] = field(repr=False)


def env_setting(text: str) -> tuple[str, str]:
    """``NAME=VALUE`` (an empty value allowed) as a pair: an environment setting for one stack alone."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    return name, value


def _popen(cmd: list[str], log: Path, env: dict[str, str] | None = None,
           drop: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    # process_group=0: its own group (stopped as one), in this session (see the module docstring).
    full = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in drop}
    return subprocess.Popen(cmd, env=full, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, process_group=0)


def _stop_group(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, what: str, timeout_s: float = START_TIMEOUT_S,
               headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    with stopped_if_start_fails(lambda: _stop_group(proc)):
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
                raise StackUnavailable(f"{what} exited with code {proc.returncode}: {tail[-600:]}")
            try:
                if httpx.get(url, timeout=2, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise StackUnavailable(f"{what} did not answer {url} within {timeout_s:.0f} s; see {log}")


# --- the engine settings -------------------------------------------------------------------------------------

_RESOLVE = """
import json, sys
from tessera.engine.capabilities import ask_vllm, resolve
from tessera.engine.config import EngineConfig
config = EngineConfig(model=sys.argv[1], served_model_name=sys.argv[2])
res = resolve(config, ask_vllm(config))
print("RESOLVED " + json.dumps({"config": res.config.model_dump(mode="json"),
                                "fallbacks": [f.describe() for f in res.fallbacks]}))
"""


def resolved_engine(model_dir: Path) -> dict[str, Any]:
    """Tessera's default EngineConfig for ``model_dir`` as this machine resolves it (capabilities.resolve over
    vLLM's own answers), asked in a subprocess so this client never imports vLLM."""
    out = subprocess.run([str(BIN / "python"), "-c", _RESOLVE, str(model_dir), MODEL_NAME], capture_output=True,
                         text=True, env={**os.environ, **ENGINE_ENV}, timeout=300)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESOLVED ")), None)
    if line is None:
        raise RuntimeError(f"could not resolve Tessera's engine config: {out.stderr[-2000:]}")
    resolved: dict[str, Any] = json.loads(line.removeprefix("RESOLVED "))
    return resolved


def vllm_serve_args(config: dict[str, Any]) -> list[str]:
    """vLLM OpenAI server flags equal to the engine settings of a resolved EngineConfig (its ``to_vllm_kwargs``)
    that are not Tessera's own features (KV events, per-request speculation metrics)."""
    kv_dtype = "fp8_per_token_head" if config["kv_scale_mode"] == "dynamic" else config["kv_cache_dtype"]
    args = ["--model", config["model"], "--served-model-name", config["served_model_name"], "--dtype", config["dtype"],
            "--kv-cache-dtype", kv_dtype, "--block-size", str(config["block_size"]),
            "--max-model-len", str(config["max_model_len"]), "--max-num-seqs", str(config["max_num_seqs"]),
            "--scheduling-policy", config["scheduling_policy"], "--seed", str(config["seed"]),
            "--gpu-memory-utilization", str(config["gpu_memory_utilization"]),
            "--enable-prefix-caching" if config["enable_prefix_caching"] else "--no-enable-prefix-caching"]
    if config["enforce_eager"]:
        args.append("--enforce-eager")
    if config["max_num_batched_tokens"] is not None:
        args += ["--max-num-batched-tokens", str(config["max_num_batched_tokens"])]
    spec = config["speculative"]
    if spec is not None:
        vllm_spec: dict[str, Any] = {"method": spec["method"], "num_speculative_tokens": spec["num_speculative_tokens"]}
        if spec["method"] == "ngram":
            vllm_spec |= {key: spec[key] for key in ("prompt_lookup_min", "prompt_lookup_max")}
        if spec["draft_model"]:
            vllm_spec["model"] = spec["draft_model"]
        args += ["--speculative-config", json.dumps(vllm_spec)]
    return args


# --- the stacks ----------------------------------------------------------------------------------------------

def start_vllm(engine: dict[str, Any], work: Path, extra_env: dict[str, str] | None = None) -> Running:
    """vLLM's OpenAI server with Tessera's engine settings. ``extra_env``: environment for this server alone
    (an ablation's arm: the baseline run under a setting `tessera up` gives its engines)."""
    port = free_port()
    args = vllm_serve_args(engine["config"])
    env = {**ENGINE_ENV, **(extra_env or {})}
    log = work / "vllm.log"
    # NOTE: not the `vllm serve` script: with the CPU build installed as `vllm-cpu` it fails on
    # importlib.metadata.version("vllm"); the module entry point is the same server.
    proc = _popen([str(BIN / "python"), "-m", SERVER_MODULE, *args, "--host", "127.0.0.1", "--port", str(port)],
                  log, env)
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/v1/models", proc, log, "vLLM's OpenAI server")
    return Running("vllm", Target(url, MODEL_NAME), {proc.pid: "engine"},
                   {"command": f"python -m {SERVER_MODULE} {' '.join(args)}", "env": env,
                    "fallbacks": engine["fallbacks"], "log": str(log)}, lambda: _stop_group(proc))


def start_router(vllm: Running, work: Path) -> Running:
    binary = STACK_VENV / "bin" / "vllm-router"
    if not binary.exists():
        raise StackUnavailable(f"{binary} is missing: `make bench-stack` installs vllm-router==0.1.17 there")
    port = free_port()
    log = work / "vllm-router.log"
    # One worker: the policy only matters with several; round_robin has no per-request tree work.
    cmd = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", vllm.target.base_url,
           "--policy", "round_robin", "--log-level", "warning"]
    proc = _popen(cmd, log)
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/v1/models", proc, log, "vllm-router", timeout_s=120)
    return Running("vllm+router", Target(url, MODEL_NAME), {**vllm.roots, proc.pid: "router"},
                   {**vllm.ran_with, "router": " ".join(cmd[1:]), "router_version": _version("vllm-router"),
                    "log": str(log)}, lambda: _stop_group(proc))


def start_litellm(vllm: Running, work: Path) -> Running:
    binary = STACK_VENV / "bin" / "litellm"
    if not binary.exists():
        raise StackUnavailable(f"{binary} is missing: `make bench-stack` installs litellm[proxy] there")
    port = free_port()
    config = {"model_list": [{"model_name": MODEL_NAME, "litellm_params": {
                  "model": f"hosted_vllm/{MODEL_NAME}", "api_base": f"{vllm.target.base_url}/v1", "api_key": "none"}}],
              "general_settings": {"master_key": LITELLM_KEY},
              "litellm_settings": {"telemetry": False}}
    config_path = work / "litellm.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    log = work / "litellm.log"
    # No cost-map download (nothing outside is reachable), no database (DATABASE_URL unset, not empty: LiteLLM
    # refuses an empty one): the master key is the only key.
    env = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR"}
    cmd = [str(binary), "--config", str(config_path), "--host", "127.0.0.1", "--port", str(port)]
    proc = _popen(cmd, log, env, drop=("DATABASE_URL",))
    url = f"http://127.0.0.1:{port}"
    _wait_http(f"{url}/health/liveliness", proc, log, "litellm proxy", timeout_s=240)
    return Running("vllm+litellm", Target(url, MODEL_NAME, LITELLM_KEY), {**vllm.roots, proc.pid: "proxy"},
                   {**vllm.ran_with, "proxy": " ".join(cmd[1:]) + " (master key, no DB, 1 worker)",
                    "proxy_version": _version("litellm"), "log": str(log)}, lambda: _stop_group(proc))


def start_tessera(model_dir: Path, work: Path, ray_worker_niceness: int | None = None,
                  extra_args: list[str] | None = None, extra_env: dict[str, str] | None = None) -> Running:
    """``tessera up`` as a user starts it, then a tenant through ``tessera tenants create``.

    NOTE: Ray's raylet starts its workers, the engine replica and its vLLM processes among them, at niceness
    15 unless ``RAY_worker_niceness`` says otherwise; `tessera up` sets 0 (local/ray_settings.py).
    ``ray_worker_niceness`` overrides it (None: what `tessera up` sets, as a user runs it); the report states
    the niceness each engine process ran at. ``extra_args``: more `tessera up` options (an experiment's arm,
    e.g. ``--no-cpu-split``), named in the report's command; ``extra_env``: environment for `tessera up` alone
    (e.g. an OpenMP setting the engine should get and vLLM alone should not), named in the report too."""
    port = free_port()
    # A state directory per start: `tessera up` keeps its Redis data there, and a second round on the first
    # round's directory would find its tenant already made.
    state = Path(tempfile.mkdtemp(prefix="tessera-state-", dir=work))
    log = work / f"{state.name}.log"  # `tessera up`'s output, beside its state directory
    cmd = [str(BIN / "tessera"), "up", "--model", str(model_dir), "--engines", "1", "--port", str(port),
           "--state-dir", str(state), *(extra_args or [])]
    env = {**os.environ, **(extra_env or {})}
    if ray_worker_niceness is not None:
        env["RAY_worker_niceness"] = str(ray_worker_niceness)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, process_group=0)
    banner: list[str] = []
    up = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        with log.open("wb") as out:
            for raw in proc.stdout:
                out.write(raw)
                out.flush()
                line = raw.decode(errors="replace").rstrip()
                if "Tessera is up" in line or (banner and not up.is_set()):
                    banner.append(line)
                if line.startswith("Stop: Ctrl-C"):
                    up.set()

    threading.Thread(target=pump, name="tessera-up-log", daemon=True).start()

    def stop() -> None:
        # Ctrl-C, as a user stops it: tessera up then stops the controller, the gateway, Ray and Redis in order.
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                _stop_group(proc, signal.SIGKILL)

    with stopped_if_start_fails(stop):
        deadline = time.monotonic() + START_TIMEOUT_S
        while not up.wait(1.0):
            if proc.poll() is not None or time.monotonic() > deadline:
                _stop_group(proc, signal.SIGKILL)
                tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-4:])
                raise StackUnavailable(f"tessera up did not come up (code {proc.returncode}): {tail[-600:]}")
        redis_url = (state / "run" / "redis_url").read_text().strip()
        created = subprocess.run([str(BIN / "tessera"), "tenants", "create", "bench"], capture_output=True, text=True,
                                 env={**os.environ, "TESSERA_REDIS_URL": redis_url}, timeout=60)
        match = re.search(r"^key: (\S+)", created.stdout, re.MULTILINE)
        if match is None:
            raise StackUnavailable(f"tessera tenants create failed: {created.stdout} {created.stderr}")
    engines = [ln.strip() for ln in banner if ln.strip().startswith(MODEL_NAME) or ln.strip().startswith("!")]
    return Running("tessera", Target(f"http://127.0.0.1:{port}", MODEL_NAME, match.group(1)), {proc.pid: "up"},
                   {"command": " ".join(["tessera", *cmd[1:]]), "engines": engines, "log": str(log),
                    "defaults": "2 gateway workers, KV-eviction controller on, prefix_affinity routing, "
                                "KV events, tracing to the state dir",
                    "RAY_worker_niceness": "tessera up's (0)" if ray_worker_niceness is None
                    else str(ray_worker_niceness),
                    **({"environment": " ".join(f"{k}={v}" for k, v in extra_env.items())} if extra_env else {})},
                   stop)


def _version(dist: str) -> str:
    out = subprocess.run([str(STACK_VENV / "bin" / "python"), "-c",
                          f"import importlib.metadata as m; print(m.version({dist!r}))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "?"
