# syntax=docker/dockerfile:1.7
# The serving image: the CUDA build of vLLM, Ray Serve and Tessera. The chart runs it as the RayService's
# head and GPU workers (engine replicas) and as the gateway (which tokenizes with the models' tokenizers).
#
#   docker build -f docker/serving.Dockerfile -t registry.example.com/tessera/serving:0.1.0 .
#
# Base and Ray are pinned to the versions the rest of the project uses: vLLM 0.32.0 (Makefile
# VLLM_PACKAGE) and Ray 2.60.0 (requirements.txt; helm/tessera/values.yaml rayService.rayVersion).
# Pin the base by digest too for reproducible builds: --build-arg VLLM_IMAGE=vllm/vllm-openai:v0.32.0@sha256:...
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}

ARG RAY_VERSION=2.60.0
ARG UID=1000
ARG GID=1000

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/tessera \
    HF_HOME=/home/tessera/.cache/huggingface

USER root
# wget: the chart's Ray probes call the raylet and dashboard health endpoints with it.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget \
    && rm -rf /var/lib/apt/lists/*
# The chart runs every pod as UID/GID 1000 (restricted Pod Security Standard: non-root, numeric).
RUN (getent group "${GID}" || groupadd --gid "${GID}" tessera) \
    && (getent passwd "${UID}" || useradd --uid "${UID}" --gid "${GID}" --no-create-home --shell /bin/bash tessera) \
    && mkdir -p /home/tessera/.cache \
    && chown -R "${UID}:${GID}" /home/tessera

WORKDIR /opt/tessera
COPY requirements.txt ./requirements.txt
COPY platform/pyproject.toml platform/pyproject.toml
# setup.py builds the gateway's four steps in C (tessera/gateway/_delta_chunk.c, tessera/routing/_pod_replay.c,
# tessera/routing/_chain_lookup.c, tessera/routing/_affinity_rank.c)
# where the image has a C compiler and Python's headers; without them the package installs and the gateway runs
# their Python twins.
COPY platform/setup.py platform/setup.py
COPY platform/src platform/src
# The base image's torch and vLLM stay as they are: the constraints pin only what Tessera adds.
RUN python3 -m pip install --constraint requirements.txt "ray[serve]==${RAY_VERSION}" ./platform \
    && python3 -c "import vllm, ray.serve, tessera.engine.config, tessera.settings"

USER ${UID}:${GID}
WORKDIR /home/tessera
# KubeRay starts Ray itself (ray start ... in the container command); the gateway's command is set by the chart.
ENTRYPOINT []
CMD ["bash"]
