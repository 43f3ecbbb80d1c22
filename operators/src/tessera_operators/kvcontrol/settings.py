"""The controller's environment settings: the shared ``TESSERA_*`` ones plus ``TESSERA_KVCONTROL_*``."""

from __future__ import annotations

from pydantic import Field, model_validator

from tessera.settings import TesseraSettings

from .policy import PolicyConfig


class KVControlSettings(TesseraSettings):
    """Set by the Helm chart's kvcontrol Deployment (templates/kvcontrol.yaml) or by command-line flags."""

    kvcontrol_metrics_port: int = Field(
        default=9400, ge=0, le=65535, description="Port of the Prometheus /metrics endpoint (0: do not serve)."
    )
    kvcontrol_poll_interval_s: float = Field(
        default=0.2, gt=0.0, description="How often each loop polls its engine's /stats and /requests and decides."
    )
    kvcontrol_discovery_interval_s: float = Field(
        default=1.0, gt=0.0, description="How often the registry is read for engines that came or went."
    )
    kvcontrol_tenant_refresh_s: float = Field(
        default=2.0, gt=0.0, description="How often tenants (cache salts, KV quotas) are re-read from Redis."
    )
    # NOTE: the flags are refreshed every TTL/3 by the loop that holds them, and a loop waits on its engine's
    # HTTP endpoint: 3 s let a flag lapse (and flap) whenever a saturated engine answered 2 s late. 10 s
    # tolerates a 6 s stall and still clears a dead controller's flags within 10 s.
    kvcontrol_flag_ttl_s: int = Field(
        default=10, ge=1,
        description="TTL of the demotion and pressure flags, seconds; refreshed while they hold, so a dead "
        "controller cannot leave a tenant demoted or an engine flagged.",
    )
    kvcontrol_observe_only: bool = Field(
        default=False, description="Keep the ledger, metrics and eviction spans, but take no action."
    )
    kvcontrol_log_level: str = Field(
        default="INFO", description="Log level; DEBUG logs every loop's snapshot and decisions on every poll."
    )
    kvcontrol_model: str | None = Field(default=None, description="Control only the engines serving this model.")
    kvcontrol_shard: int = Field(
        default=0, ge=0,
        description="This process's shard, in [0, kvcontrol_shards): it controls the engines whose id hashes "
        "there (sharding.py). The chart runs one controller per shard.",
    )
    kvcontrol_policy: PolicyConfig = Field(
        default_factory=PolicyConfig, description="Watermarks and levers, as JSON (see policy.PolicyConfig)."
    )

    @model_validator(mode="after")
    def _shard_in_range(self) -> KVControlSettings:
        if self.kvcontrol_shard >= self.kvcontrol_shards:
            raise ValueError(f"TESSERA_KVCONTROL_SHARD is {self.kvcontrol_shard}, but there are only "
                             f"{self.kvcontrol_shards} shards (TESSERA_KVCONTROL_SHARDS): shards count from 0")
        return self
