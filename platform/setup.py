"""The one thing pyproject.toml cannot say: the optional C extensions (tessera/gateway/_delta_chunk.c, the
relay's per-token step; tessera/routing/_pod_replay.c, a pod worker's per-decision replay of the other workers'
change records; tessera/routing/_chain_lookup.c, the local prefix index's lookup;
tessera/routing/_affinity_rank.c, prefix_affinity's usual decision).

``optional=True``: where no C compiler is (a slim image, say), the package installs without them and the
gateway uses the Python implementation of the same step (tessera/gateway/delta_chunk.py,
tessera/routing/pod_view.py, tessera/routing/local_index.py, tessera/routing/policies.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tessera.gateway._delta_chunk", ["src/tessera/gateway/_delta_chunk.c"],
                             optional=True, extra_compile_args=["-O2"]),
                   Extension("tessera.routing._pod_replay", ["src/tessera/routing/_pod_replay.c"],
                             optional=True, extra_compile_args=["-O2"]),
                   Extension("tessera.routing._chain_lookup", ["src/tessera/routing/_chain_lookup.c"],
                             optional=True, extra_compile_args=["-O2"]),
                   Extension("tessera.routing._affinity_rank", ["src/tessera/routing/_affinity_rank.c"],
                             optional=True, extra_compile_args=["-O2"])])
