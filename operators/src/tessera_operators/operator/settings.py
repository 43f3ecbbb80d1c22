"""The operator's environment settings: the shared ``TESSERA_*`` ones plus its own ``TESSERA_OPERATOR_*``."""

from __future__ import annotations

from pydantic import Field

from tessera.settings import TesseraSettings


class OperatorSettings(TesseraSettings):
    """Set by the Helm chart's operator Deployment (templates/operator.yaml)."""

    operator_namespace: str = Field(
        default="default", description="Namespace whose Tenant and Model objects the operator reconciles."
    )
    operator_ray_service: str = Field(
        default="tessera-engine", description="The RayService whose serveConfigV2 Model objects edit."
    )
    operator_health_port: int = Field(default=8080, ge=1, le=65535, description="Port of kopf's /healthz.")
    operator_discovery_port: int = Field(
        default=0, ge=0, le=65535,
        description="Port of the engine replicas' Prometheus service discovery (GET /engine-targets); 0: off.",
    )
