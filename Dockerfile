# One image for every pdserve service (`python -m services.<name> ...`; see docker-compose.yml).
#
#   docker build -t pdserve:cpu .                                   # CPU (default)
#   docker build -t pdserve:cuda \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .   # NVIDIA GPUs
#
# The CUDA runtime comes with the torch wheel and UCX with the nixl-cu12 wheel; the GPU driver is
# the host's (run with the NVIDIA container toolkit: `gpus: all` / `--gpus all`).
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app

RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 libnuma1 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first: the largest layer, reused while the project's code changes
RUN pip install torch==2.13.0 --index-url ${TORCH_INDEX_URL}
COPY . .
# NIXL's wheel depends on a CUDA torch and both CUDA flavours: take the cu12 build alone (as `make install`).
RUN pip install -e . \
    && pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1 \
    && python -m proto.build

# gRPC 50051-50071 (prefill, kvstore, decode), router HTTP 8000 + gRPC 50050, metrics 91xx
EXPOSE 8000 50050 50051 50060 50071 9100 9151 9160 9171
CMD ["python", "-m", "services.cli", "--help"]
