# batchq's runtime image: the producers (`batchq serve`), the example trainer and the
# exporter of docker-compose.yml. Slim Python, no compilers, no test or dev extras, and a
# non-root user. Build: `docker build -t batchq:local .` (compose does it for you).

# --- build a wheel of batchq (needs setuptools, not needed at run time) ------------------
FROM python:3.12-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY batchq ./batchq
COPY producer ./producer
COPY consumer ./consumer
RUN pip wheel --no-deps --wheel-dir /wheels .

# --- the runtime ------------------------------------------------------------------------
FROM python:3.12-slim
# Extras to install with batchq: the exporter's prometheus-client (comma-separated; ""
# for none). Never the test or dev extras.
ARG BATCHQ_EXTRAS="exporter"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONPATH=/app
COPY --from=build /wheels /wheels
RUN set -eux; \
    wheel="$(ls /wheels/batchq-*.whl)"; \
    if [ -n "$BATCHQ_EXTRAS" ]; then wheel="batchq[$BATCHQ_EXTRAS] @ file://$wheel"; fi; \
    pip install "$wheel"; \
    rm -rf /wheels; \
    useradd --create-home --home-dir /home/batchq --uid 10001 --user-group \
        --shell /usr/sbin/nologin batchq
WORKDIR /app
# The factories and the trainer the compose stack runs (PYTHONPATH=/app imports them);
# mount or COPY your own pipeline module next to them.
COPY examples ./examples
USER batchq
CMD ["batchq", "--help"]
