# syntax=docker/dockerfile:1.7
# moe-serve on a CUDA host: `docker compose up` (docker-compose.yml) or
#   docker build -t moe-serve:0.1.0 . && docker run --gpus all --ipc=host -p 8000:8000 -p 8001:8001 moe-serve:0.1.0
#
# Two stages. `build` compiles the csrc extension (schedule builder) for sm_90 (H100/H200) and
# sm_120 (RTX 50xx / RTX PRO Blackwell) and builds the wheel; `runtime` installs torch and the wheel
# on the CUDA runtime image and runs as an unprivileged user. The Python steps live in
# deploy/docker/*.sh: tests/deploy/test_image_recipe.py runs the same scripts in a fresh virtual
# environment (CPU torch), so this recipe is tested without a Docker engine.
#
# CUDA 13.0 to match the torch build PyPI serves for torch==2.13.0 on Linux x86_64 (cu130); the
# runtime image carries the libcudart the csrc library links against. Pin by digest for
# bit-for-bit reproducible builds (docs/DEPLOY.md).

ARG TORCH_REQUIREMENT="torch==2.13.0"

# ---- build: csrc library + wheel ---------------------------------------------------------------
FROM nvidia/cuda:13.0.2-devel-ubuntu24.04 AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Versions come from the pinned Ubuntu 24.04 base (Python 3.12); pinning apt versions on top
# would break the build at every Ubuntu security update. g++ and the Python headers: the host
# side of the csrc compile.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ python3 python3-dev python3-venv \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv

WORKDIR /src
COPY deploy/docker/ /opt/moe-serve/
COPY pyproject.toml README.md ./
COPY service/ service/
COPY csrc/ csrc/

ARG TORCH_REQUIREMENT
ARG BUILD_CSRC=1
ENV TORCH_CUDA_ARCH_LIST="9.0;12.0"
RUN --mount=type=cache,target=/root/.cache/pip /opt/moe-serve/build.sh /dist

# ---- runtime -----------------------------------------------------------------------------------
FROM nvidia/cuda:13.0.2-runtime-ubuntu24.04 AS runtime
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

LABEL org.opencontainers.image.title="moe-serve" \
      org.opencontainers.image.description="A fused tensor-parallel Mixture-of-Experts layer served over HTTP and gRPC" \
      org.opencontainers.image.version="0.1.0"

# gcc and the Python headers: Triton compiles its kernel launcher with them at run time.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-dev python3-venv gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# A fixed, unprivileged UID/GID (Kubernetes' runAsNonRoot checks the numeric user).
RUN groupadd --gid 10001 moe \
 && useradd --uid 10001 --gid moe --no-log-init --create-home --shell /usr/sbin/nologin moe

# Multicast off (NVLink SHARP in NCCL, multicast in symmetric memory): the design must also run on
# PCIe hosts, and multicast objects need fabric-manager support most hosts lack.
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1
RUN python3 -m venv /opt/venv

COPY deploy/docker/ /opt/moe-serve/
ARG TORCH_REQUIREMENT
RUN --mount=type=cache,target=/root/.cache/pip \
    --mount=type=bind,from=build,source=/dist,target=/dist \
    /opt/moe-serve/install.sh /dist

USER 10001:10001
WORKDIR /home/moe
EXPOSE 8000 8001
# The start period covers the rank group start and warm-up of the seed preset (MOE_START_TIMEOUT_S
# is 300 s); failures inside it do not count.
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/moe-serve/healthcheck.py"]
ENTRYPOINT ["moe-serve"]
