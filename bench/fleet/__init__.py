"""``make bench-fleet``'s parts (bench/bench_fleet.py runs them): ``workload`` (the seeded request sequence
and its ideal hit rate; pure), ``floors`` (the TTFTs no router beats: alone on an idle replica, uncached
and with the ideal cache; pure), ``summary`` (per-policy figures and the goals' verdicts; pure), ``procs``
(the simulated fleet and vLLM's router as processes), ``drive`` (Tessera's routers in process, and an
OpenAI client for vllm-router) and ``plot``."""
