# Dashboard image: reads Redis only, so it needs no torch and no Ray cluster.
# Build from the repository root: docker build -f docker/dashboard.Dockerfile -t shardcache-dashboard:0.1.0 .
FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY sdk ./sdk
COPY services ./services
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
RUN useradd --uid 1000 --create-home shardcache
COPY --from=build /wheels /tmp/wheels
# The dashboard imports only redis, starlette, uvicorn and prometheus-client.
RUN pip install --no-cache-dir --no-deps /tmp/wheels/shardcache-0.1.0-py3-none-any.whl \
    && pip install --no-cache-dir "redis==5.2.1" "starlette==0.46.2" "uvicorn==0.34.3" \
       "prometheus-client==0.22.1" "pydantic-settings==2.9.1" "typer==0.16.0" "rich==14.0.0" \
       "numpy==2.2.6" "filelock==3.18.0" "fsspec==2025.5.1" \
    && rm -rf /tmp/wheels
USER 1000
EXPOSE 8365
HEALTHCHECK NONE
ENTRYPOINT ["shardcache", "dashboard", "--host", "0.0.0.0"]
