"""What ``tessera up`` prints once the platform is ready: how to call it, what each engine runs, where the
traces go. A pure function of the platform's state, so its content is tested without starting anything."""

from __future__ import annotations

from pathlib import Path

from tessera.registry import EngineRecord


def engine_lines(records: list[EngineRecord]) -> list[str]:
    """One line per replica with the effective KV dtype, capacity and speculative method, then its fallbacks."""
    lines = []
    for record in sorted(records, key=lambda r: r.engine_id):
        lines.append(f"  {record.engine_id}: KV cache {record.kv_cache_dtype}, {record.kv_capacity_tokens:,} tokens "
                     f"({record.num_gpu_blocks:,} blocks of {record.block_size}), speculative decoding "
                     f"{record.speculative_method}")
        lines += [f"    ! {fallback}" for fallback in record.fallbacks.splitlines() if fallback]
    return lines


def up_banner(base_url: str, model: str, key: str, records: list[EngineRecord], trace_dir: Path,
              kvcontrol_metrics_url: str, redis_data_dir: Path | None = None, gateway_metrics_url: str = "") -> str:
    """``redis_data_dir``: where the embedded Redis keeps its data; None: an external Redis (``redis_url``).
    ``gateway_metrics_url``: the gateway's /metrics, on a port apart from the API."""
    request = ('{"model": "' + model + '", "messages": [{"role": "user", "content": "Hello"}], '
               '"max_tokens": 32, "stream": true}')
    controller = (f"KV-eviction controller: metrics {kvcontrol_metrics_url}" if kvcontrol_metrics_url
                  else "KV-eviction controller: off (--no-kvcontrol)")
    return "\n".join([
        "",
        f"Tessera is up: gateway {base_url}, {len(records)} engine replica(s) serving '{model}':",
        *engine_lines(records),
        *([f"Gateway metrics (every worker, not on the API port): {gateway_metrics_url}"]
          if gateway_metrics_url else []),
        controller,
        f"Demo tenant key (shown once): {key}",
        "",
        f"  curl -N {base_url}/v1/chat/completions \\",
        f'    -H "Authorization: Bearer {key}" -H "Content-Type: application/json" \\',
        f"    -d '{request}'",
        "",
        *([f"Redis data (tenants, keys, budgets, usage; kept between runs, delete to start empty): {redis_data_dir}"]
          if redis_data_dir is not None else []),
        f"Traces (gateway, engines, controller): {trace_dir}",
        f"  Why were the slowest requests slow:  .venv/bin/tessera traces analyze {trace_dir} -p 99",
        "Manage tenants: .venv/bin/tessera tenants --help     What runs here: .venv/bin/tessera doctor",
        "Stop: Ctrl-C",
        "",
    ])
