"""``make bench-fleet``'s parts (bench/bench_fleet.py runs them): ``workload`` (the seeded request sequence
and its ideal hit rate; pure), ``summary`` (per-policy figures and the goals' verdicts; pure), ``procs``
(the simulated fleet and vLLM's router as processes), ``drive`` (Tessera's routers in process, and an
OpenAI client for vllm-router) and ``plot``."""
