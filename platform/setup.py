"""The one thing pyproject.toml cannot say: the optional C extension (tessera/gateway/_delta_chunk.c).

``optional=True``: where no C compiler is (a slim image, say), the package installs without it and the gateway
uses the Python implementation of the same step (tessera/gateway/delta_chunk.py).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("tessera.gateway._delta_chunk", ["src/tessera/gateway/_delta_chunk.c"],
                             optional=True, extra_compile_args=["-O2"])])
