"""Prometheus metrics of the controller, served at ``/metrics`` on ``TESSERA_KVCONTROL_METRICS_PORT``.

Names match the Helm chart's Grafana dashboard (helm/tessera/dashboards/tessera.json).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Event-to-ledger lag buckets, seconds: a keeping-up controller sits in the first few; seconds mean behind.
LAG_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.blocks_total = Gauge("tessera_kv_blocks_total", "KV blocks of the engine", ["engine"], registry=r)
        self.blocks_used = Gauge("tessera_kv_blocks_used", "KV blocks held by running requests",
                                 ["engine"], registry=r)
        self.tenant_blocks = Gauge("tessera_kv_tenant_blocks", "Cached KV blocks per tenant (the ledger)",
                                   ["engine", "tenant"], registry=r)
        self.evictions = Counter("tessera_kv_evictions_total", "Cached KV blocks evicted, by owner and cause",
                                 ["engine", "tenant", "cause"], registry=r)
        self.actions = Counter("tessera_kvcontrol_actions_total", "Controller actions taken",
                               ["engine", "action", "tenant"], registry=r)
        self.requests = Gauge("tessera_engine_requests", "Requests in the engine by state (running, waiting), "
                              "as the controller polled them", ["engine", "state"], registry=r)
        self.pressure = Gauge("tessera_engine_kv_pressure", "1 while the engine's pressure flag is set",
                              ["engine"], registry=r)
        self.batches = Counter("tessera_kvcontrol_event_batches_total", "KV event batches applied",
                               ["engine"], registry=r)
        self.events = Counter("tessera_kvcontrol_events_total", "KV events applied to the ledgers (one per block "
                              "stored or removed, one per AllBlocksCleared)", registry=r)
        # NOTE: one series for the process, not one per engine: the lag says whether this controller keeps up
        # with all its engines (a per-engine histogram at 1,000 engines would be 16,000 series).
        self.event_lag = Histogram("tessera_kvcontrol_event_lag_seconds",
                                   "From an engine publishing a KV event batch (its wall-clock ts) to the ledger "
                                   "having applied it", buckets=LAG_BUCKETS_S, registry=r)
        self.missed = Counter("tessera_kvcontrol_missed_batches_total",
                              "KV event batches lost before reaching the controller (sequence gaps)",
                              ["engine"], registry=r)
        self.ledger_stale = Gauge("tessera_kvcontrol_ledger_stale",
                                  "1 while the engine's ledger, reset after lost KV events, holds its decisions "
                                  "(kvcontrol/resync.py)", ["engine"], registry=r)
        self.unknown_removals = Counter("tessera_kvcontrol_unknown_removals_total",
                                        "BlockRemoved events for blocks the ledger never saw stored", ["engine"],
                                        registry=r)
        self.errors = Counter("tessera_kvcontrol_errors_total", "Control-loop iterations that failed",
                              ["engine", "stage"], registry=r)
        self.engines = Gauge("tessera_kvcontrol_engines", "Engines with a running control loop", registry=r)
        self._tenant_labels: dict[str, set[str]] = {}

    def observe_batch(self, engine: str, num_events: int, lag_s: float) -> None:
        """One batch of ``num_events`` applied to ``engine``'s ledger ``lag_s`` after the engine published it."""
        self.batches.labels(engine).inc()
        self.events.inc(num_events)
        self.event_lag.observe(lag_s)

    def set_tenant_blocks(self, engine: str, blocks: dict[str, int]) -> None:
        previous = self._tenant_labels.get(engine, set())
        for tenant in previous - set(blocks):
            self.tenant_blocks.labels(engine, tenant).set(0)
        for tenant, num in blocks.items():
            self.tenant_blocks.labels(engine, tenant).set(num)
        self._tenant_labels[engine] = previous | set(blocks)

    def forget_engine(self, engine: str) -> None:
        for tenant in self._tenant_labels.pop(engine, set()):
            self.tenant_blocks.remove(engine, tenant)
        for gauge in (self.blocks_total, self.blocks_used, self.pressure, self.ledger_stale):
            try:
                gauge.remove(engine)
            except KeyError:
                pass
        for state in ("running", "waiting"):
            try:
                self.requests.remove(engine, state)
            except KeyError:
                pass

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:  # all interfaces: a pod's metrics port
        """Starts the exporter thread (every path answers; the Helm chart probes ``/metrics``)."""
        start_http_server(port, addr=addr, registry=self.registry)
