# syntax=docker/dockerfile:1.7
# The control-plane image: the kopf operator (tessera-operator) and the KV-eviction controller
# (tessera-kvcontrol). No vLLM, no CUDA: a slim Python with the two Tessera distributions.
#
#   docker build -f docker/operator.Dockerfile -t registry.example.com/tessera/operator:0.1.0 .
#
# Pin the base by digest too for reproducible builds: --build-arg PYTHON_IMAGE=python:3.11.11-slim-bookworm@sha256:...
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
WORKDIR /src
COPY requirements.txt ./requirements.txt
COPY platform/pyproject.toml platform/pyproject.toml
COPY platform/setup.py platform/setup.py
COPY platform/src platform/src
COPY operators/pyproject.toml operators/pyproject.toml
COPY operators/src operators/src
RUN /opt/venv/bin/pip install --constraint requirements.txt ./platform ./operators \
    && /opt/venv/bin/python -c "import kopf, kubernetes, tessera_operators.operator"

FROM ${PYTHON_IMAGE}
ARG UID=1000
ARG GID=1000
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:${PATH} \
    HOME=/tmp
RUN groupadd --gid "${GID}" tessera && useradd --uid "${UID}" --gid "${GID}" --no-create-home tessera
COPY --from=build /opt/venv /opt/venv
# Numeric, non-root: the kubelet can verify runAsNonRoot against it.
USER ${UID}:${GID}
CMD ["tessera-operator"]
