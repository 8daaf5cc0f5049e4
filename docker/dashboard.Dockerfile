# Dashboard image: reads Redis only, so it needs no torch and no Ray cluster.
# Build from the repository root: docker build -f docker/dashboard.Dockerfile -t shardcache-dashboard:0.1.0 .
# Without a registry, scripts/build_images.sh builds it from a local Debian base
# (BUILD_IMAGE and BASE_IMAGE).
ARG BUILD_IMAGE=python:3.11-slim-bookworm
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BUILD_IMAGE} AS build
# pip builds the wheel inside /src; a base that runs as uid 1000 could not write
# there. This stage is thrown away; the image's last USER is 1000.
# hadolint ignore=DL3002
USER 0
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY services ./services
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${BASE_IMAGE}
USER 0
# The local Debian base already has uid 1000 (`ray`); python:slim does not.
RUN id -u 1000 >/dev/null 2>&1 || useradd --uid 1000 --create-home shardcache
# The dashboard imports only redis, starlette, uvicorn and prometheus-client
# (and the CLI's typer/rich); the pins satisfy pyproject.toml's ranges
# (tests/chart/test_images.py checks that).
# A COPY, not RUN --mount=from=build: buildah (1.28) does not mount a stage
# that it took whole from its layer cache. The wheel is small.
COPY --from=build /wheels/shardcache-0.1.0-py3-none-any.whl /tmp/wheels/
RUN pip install --no-cache-dir --no-deps /tmp/wheels/shardcache-0.1.0-py3-none-any.whl \
    && pip install --no-cache-dir "redis==5.2.1" "starlette==0.46.2" "uvicorn==0.34.3" \
       "prometheus-client==0.22.1" "pydantic-settings==2.9.1" "typer==0.16.0" "rich==14.0.0" \
       "numpy==2.2.6" "filelock==3.18.0" "fsspec==2025.5.1"
USER 1000
EXPOSE 8365
HEALTHCHECK NONE
ENTRYPOINT ["shardcache", "dashboard", "--host", "0.0.0.0"]
