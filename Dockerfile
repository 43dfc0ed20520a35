# syntax=docker/dockerfile:1
#
# LiveSpeech server image: gRPC, WebSocket + HTTP (server/web.py), metrics.
#
#   CPU (the default, python:3.11-slim):      docker build -t livespeech:cpu .
#   GPU (CUDA torch + mamba-ssm kernels):     docker build --build-arg VARIANT=gpu -t livespeech:gpu .
#   run:  docker run --rm -p 50051:50051 -p 8080:8080 -p 9464:9464 --stop-timeout 45 livespeech:cpu
#         (flags after the image are `livespeech serve` flags, e.g. --max-sessions 8)
#
# The install is scripts/install.sh, the same script the README and CI run
# (EDITABLE=0 EXTRAS="" = runtime only). Only the torch wheel's index differs: here pip
# cannot see the CPU wheel CI machines keep on disk, so the CPU build adds PyTorch's CPU
# index (otherwise PyPI's torch for Linux is the multi-GB CUDA build).
# See docs/deploy.md. The runtime images preload jemalloc: it starts lower than glibc's
# malloc and its RSS settles in long soaks (docs/reliability.md, section 4).

# cpu or gpu: which build and base the one runtime stage uses
ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Keep CUDA_VERSION and TORCH_CUDA_INDEX paired (same CUDA major.minor): mamba-ssm is
# compiled with this nvcc against that torch.
ARG CUDA_VERSION=12.8.1
ARG CUDA_UBUNTU=ubuntu24.04
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=torch==2.13.0
ARG MAMBA_SSM_SPEC=mamba-ssm==2.3.2.post1
ARG CAUSAL_CONV1D_SPEC=causal-conv1d==1.7.0

# ------------------------------------------------------------------ GPU build
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-${CUDA_UBUNTU} AS gpu-build
ARG TORCH_CUDA_INDEX
ARG TORCH_SPEC
ARG MAMBA_SSM_SPEC
ARG CAUSAL_CONV1D_SPEC
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${TORCH_CUDA_INDEX} \
    TORCH_CUDA_ARCH_LIST="8.0;8.6;8.9;9.0+PTX" \
    MAX_JOBS=4
WORKDIR /src
COPY . .
RUN VENV=/opt/livespeech EDITABLE=0 EXTRAS="" NATIVE_STEP=0 TORCH_SPEC="${TORCH_SPEC}" bash scripts/install.sh
# the `cuda` extra (mamba-ssm) builds against the installed torch: no build isolation,
# or pip would compile it against whatever torch its isolated build env downloads
RUN /opt/livespeech/bin/python -m pip install packaging==25.0 ninja==1.13.0 wheel==0.45.1 \
 && /opt/livespeech/bin/python -m pip install --no-build-isolation "${CAUSAL_CONV1D_SPEC}" "${MAMBA_SSM_SPEC}" \
 && /opt/livespeech/bin/python -P -c "import mamba_ssm, torch; print('mamba_ssm', mamba_ssm.__version__, 'torch', torch.__version__, torch.version.cuda)"
# compile the wire protocol module now: the runtime root filesystem is read-only
RUN /opt/livespeech/bin/python -P -c "import livespeech.api.protocol" \
 && /opt/livespeech/bin/livespeech serve --help > /dev/null

# ------------------------------------------------------------------ CPU build
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_CPU_INDEX
ARG TORCH_SPEC
# the C++ compiler builds the native CPU step once, here (models/native_step.py); the
# runtime image runs that build and carries no compiler
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_EXTRA_INDEX_URL=${TORCH_CPU_INDEX}
WORKDIR /src
COPY . .
RUN VENV=/opt/livespeech EDITABLE=0 EXTRAS="" TORCH_SPEC="${TORCH_SPEC}" bash scripts/install.sh
# compile the wire protocol module now: the runtime root filesystem is read-only; and
# check that the native CPU step was built (install.sh kept it beside the package)
RUN /opt/livespeech/bin/python -P -c "import livespeech.api.protocol" \
 && /opt/livespeech/bin/python -P -c "from livespeech.models import native_step; native_step.build(native_step.INSTALLED_BUILDS)" \
 && /opt/livespeech/bin/livespeech serve --help > /dev/null

# ------------------------------------------------------------------ runtime bases
# What differs between the CPU and the GPU image: the base (the CUDA runtime brings no
# Python of its own) and the device. The runtime stage below is common to both.
FROM nvidia/cuda:${CUDA_VERSION}-cudnn-runtime-${CUDA_UBUNTU} AS gpu-base
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*
ENV LIVESPEECH_DEVICE=cuda

FROM ${PYTHON_IMAGE} AS cpu-base
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libjemalloc2 \
 && rm -rf /var/lib/apt/lists/*
ENV LIVESPEECH_DEVICE=cpu

# ------------------------------------------------------------------ runtime (the image)
# VARIANT picks the pair of stages (BuildKit builds only the ones it picks)
FROM ${VARIANT}-build AS build
FROM ${VARIANT}-base AS runtime
RUN ln -s "$(ls /usr/lib/*-linux-gnu/libjemalloc.so.2)" /usr/local/lib/libjemalloc.so.2 \
 && groupadd --gid 10001 livespeech \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /var/lib/livespeech --shell /usr/sbin/nologin livespeech \
 && mkdir -p /var/lib/livespeech/voices \
 && chown -R 10001:10001 /var/lib/livespeech
COPY --from=build /opt/livespeech /opt/livespeech
COPY deploy/docker/grpc_health_check.py /usr/local/lib/livespeech/grpc_health_check.py
ENV PATH=/opt/livespeech/bin:${PATH} \
    LD_PRELOAD=/usr/local/lib/libjemalloc.so.2 \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    XDG_CACHE_HOME=/tmp/.cache \
    LIVESPEECH_HOST=0.0.0.0 \
    LIVESPEECH_PORT=50051 \
    LIVESPEECH_HTTP_PORT=8080 \
    LIVESPEECH_METRICS_PORT=9464 \
    LIVESPEECH_VOICES_DIR=/var/lib/livespeech/voices
WORKDIR /var/lib/livespeech
USER 10001:10001
EXPOSE 50051 8080 9464
# the start period covers the GPU image's slower start (CUDA context, graph capture)
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["/opt/livespeech/bin/python", "/usr/local/lib/livespeech/grpc_health_check.py"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["livespeech", "serve"]
