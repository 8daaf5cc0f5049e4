# Cache / Ray image: Ray head, cache workers, store controller and selftest.
# Build from the repository root: docker build -f docker/cache.Dockerfile -t shardcache:0.1.0 .
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY services ./services
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM rayproject/ray:2.60.0-py311-cpu
# The Ray image already runs as the non-root user `ray` (uid 1000).
USER 1000
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir /tmp/wheels/shardcache-0.1.0-py3-none-any.whl "torch==2.13.0" \
    && rm -rf /tmp/wheels
ENV PYTHONUNBUFFERED=1
EXPOSE 6379 6380 6381 10001
CMD ["ray", "start", "--head", "--block"]
