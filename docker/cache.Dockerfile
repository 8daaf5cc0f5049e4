# Cache / Ray image: Ray head, cache workers, store controller and selftest.
# Build from the repository root: docker build -f docker/cache.Dockerfile -t shardcache:0.1.0 .
# Without a registry, scripts/build_images.sh builds it from a local Debian base
# (BUILD_IMAGE and BASE_IMAGE) with a local torch index (TORCH_INDEX_URL).
ARG BUILD_IMAGE=python:3.11-slim-bookworm
ARG BASE_IMAGE=rayproject/ray:2.60.0-py311-cpu

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
# PyTorch's CPU index; the +cpu pin makes pip fail rather than fall back to the
# multi-GB CUDA build that PyPI serves under the plain version.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Both bases run as the non-root user `ray` (uid 1000) with a pip it owns.
USER 1000
# A COPY, not RUN --mount=from=build: buildah (1.28) does not mount a stage
# that it took whole from its layer cache. The wheel is small.
COPY --from=build /wheels/shardcache-0.1.0-py3-none-any.whl /tmp/wheels/
# The versions are pyproject.toml's (tests/chart/test_images.py checks they agree).
# ray[default] gives the head its dashboard and Jobs API (ray.head.jobSubmission);
# the rayproject/ray base has it already, the local Debian base does not.
RUN pip install --no-cache-dir --extra-index-url "${TORCH_INDEX_URL}" \
        "torch==2.13.0+cpu" "ray[default,data]==2.60.0" \
        /tmp/wheels/shardcache-0.1.0-py3-none-any.whl
ENV PYTHONUNBUFFERED=1
EXPOSE 6379 6380 6381 10001
CMD ["ray", "start", "--head", "--block"]
