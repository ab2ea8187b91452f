# The Stepwise image: one `stepwise` command for every role (control, worker, gateway, ...).
#
#   docker build -t stepwise:0.1.0-cpu .                                   # CPU torch (default)
#   docker build --build-arg TORCH_VARIANT=cu128 -t stepwise:0.1.0-cuda .  # a CUDA torch
#
# TORCH_VARIANT names a PyTorch wheel index (https://download.pytorch.org/whl/VARIANT); TORCH_INDEX
# overrides the whole URL (a mirror). The pods run it with a read-only root filesystem and an
# emptyDir at /tmp: everything that writes (HOME, caches, temporary files, the control plane's
# Prometheus multiprocess directory, which `stepwise control` creates under TMPDIR) lives there.

# Both stages use the same base image, so the virtual environment's interpreter path stays valid.
ARG PYTHON_IMAGE=python:3.12.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ARG TORCH_VARIANT=cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/stepwise/bin:${PATH}
# torch first and exactly, from the chosen index: the project's own `torch==2.13.0` requirement is
# then already met, so the PyPI install below never replaces it with another build. This layer does
# not depend on the sources, so rebuilding after a code change reuses it.
RUN python -m venv /opt/stepwise \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX}" "torch==2.13.0"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY control_plane/ control_plane/
COPY data_plane/ data_plane/
COPY clients/ clients/
COPY gateway/ gateway/
COPY stepwise/ stepwise/
COPY flagtypes/ flagtypes/
COPY grammars/ grammars/
# A regular (not editable) install: the runtime stage copies only the venv, the embedded model included.
RUN pip install --no-cache-dir . \
    && python -c "import torch; assert torch.__version__.split('+')[0] == '2.13.0', torch.__version__"

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="stepwise" \
      org.opencontainers.image.description="LLM serving: a CPU control plane and data-plane workers over gRPC" \
      org.opencontainers.image.version="0.1.0"
COPY --from=builder /opt/stepwise /opt/stepwise
ENV PATH=/opt/stepwise/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    HF_HOME=/tmp/.cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.cache/torchinductor \
    TRITON_CACHE_DIR=/tmp/.cache/triton
# A numeric user, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
USER 10001:10001
WORKDIR /tmp
# Control plane clients, control plane workers, gateway HTTP, worker health, metrics.
EXPOSE 50051 50052 8000 8081 9090
ENTRYPOINT ["stepwise"]
CMD ["--help"]
