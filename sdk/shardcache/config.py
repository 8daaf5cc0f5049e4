"""Client-side configuration: explicit kwargs beat ``SHARDCACHE_*`` env, env beats defaults."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shardcache.keys import DEFAULT_NAMESPACE, validate_name

__all__ = ["ClientConfig"]

DEFAULT_PREFETCH_BATCHES = 4  # enough to hide one store round trip per batch
DEFAULT_REQUEST_TIMEOUT_S = 300.0  # a cold batch may wait on slow object reads
DEFAULT_HOLD_BYTES = 2 * 2**30  # zero-copy views a process keeps between batches
# Share of chunk reads whose contents a rank checks against their checksum:
# a check costs ~0.035 ms per MB (xxh3; checksum.py), paid when a chunk is
# first mapped, never per batch, so one in ten costs well under 1% of a read.
DEFAULT_VERIFY_READS = 0.1


class ClientConfig(BaseSettings):
    """Where a training process finds the cache.

    Args:
        redis_url: Redis index URL (``redis://`` or ``rediss://``). ``None`` starts
            or finds the embedded local Redis. Defaults to ``None``.
        ray_address: Ray cluster address (``"auto"``: the Ray node running on
            this machine, e.g. in a pod that ran ``ray start``). ``None``
            attaches to the cluster this process already joined, else to
            ``RAY_ADDRESS`` when set, else to this user's embedded head
            (loopback, token auth; started when none runs), never to a
            cluster found by ``"auto"`` unasked. Defaults to ``None``.
        namespace: deployment namespace; prefixes every Redis key and names the
            Ray namespace of the store actors, so tenants sharing one Redis are
            isolated. Defaults to ``"default"``.
        prefetch_batches: batches whose object references are resolved ahead
            of the training loop. Defaults to ``4``.
        request_timeout_s: how long one batch may wait for the stores.
            Defaults to ``300``.
        hold_bytes: how many bytes of cached samples a process keeps as
            zero-copy views between batches (a warm batch then needs no Ray
            call); past it samples are read through Ray every time, so the
            stores' eviction stays in charge. Defaults to 2 GiB.
        endpoint: the node-local endpoint's Unix socket (a pod outside Ray
            reads through the cache worker of its node; the chart mounts it
            at ``/var/run/shardcache/endpoint.sock``). ``None`` uses that
            path when it exists, else the Ray path. Defaults to ``None``.
        node_name: this pod's Kubernetes node (the downward API's
            ``spec.nodeName``), named in errors. Setting it without a
            reachable endpoint is an error, never a fallback to Ray.
            Defaults to ``None``.
        allow_remote: with no endpoint on this node, stream chunks from a
            cache worker on another node at ``remote_url``.
            Defaults to ``False``.
        remote_url: the cache workers' streaming Service: ``tcp://host:port``
            or ``tls://host:port`` (the TCP stream, the faster path), or
            ``grpc://`` / ``grpc+tls://host:port`` (Arrow Flight). Defaults
            to ``None``.
        remote_token: the token of that service. Defaults to ``None``.
        remote_ca: a PEM file of the CA that signed the service's
            certificate (``tls``, ``grpc+tls``). Defaults to ``None``.
        verify_reads: the share (0 to 1) of chunks whose contents a rank
            checks against the checksum written when they were built, when it
            maps them; a chunk that fails is never served: it is dropped and
            rebuilt from the source once. ``1.0`` checks every chunk read.
            Defaults to ``0.1``.
    """

    model_config = SettingsConfigDict(env_prefix="SHARDCACHE_", extra="ignore")

    redis_url: str | None = None
    ray_address: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    prefetch_batches: int = Field(default=DEFAULT_PREFETCH_BATCHES, ge=0)
    request_timeout_s: float = Field(default=DEFAULT_REQUEST_TIMEOUT_S, gt=0)
    hold_bytes: int = Field(default=DEFAULT_HOLD_BYTES, ge=0)
    endpoint: str | None = None
    node_name: str | None = None
    allow_remote: bool = False
    remote_url: str | None = None
    remote_token: str | None = Field(default=None, repr=False)
    remote_ca: str | None = None
    verify_reads: float = Field(default=DEFAULT_VERIFY_READS, ge=0.0, le=1.0)

    @field_validator("namespace")
    @classmethod
    def _check_namespace(cls, value: str) -> str:
        return validate_name("namespace", value)

    @field_validator("redis_url")
    @classmethod
    def _check_redis_url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                f"redis_url must start with redis://, rediss:// or unix://, got "
                f"scheme {value.split(':', 1)[0]!r}. Set SHARDCACHE_REDIS_URL."
            )
        return value
