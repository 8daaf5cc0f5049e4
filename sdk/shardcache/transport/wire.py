"""The endpoint's wire contract, shared by the rank's clients and the cache worker.

Control travels as length-prefixed JSON frames (4-byte big-endian length,
then UTF-8 JSON; nothing is unpickled) with chunk files attached as
read-only descriptors (``SCM_RIGHTS``) on the Unix socket; across nodes
the TCP stream sends the files' bytes after the frame (``stream.py``), and
Arrow Flight carries the same JSON. An error travels as ``{"error": {"type", "message"}}``
and is raised again on the rank as the project's own type. Callables
travel by importable name (``module:qualname``), checked by fingerprint on
the worker's side.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from shardcache import errors
from shardcache.errors import ConfigError
from shardcache.fingerprint import fingerprint

__all__ = [
    "DEFAULT_SOCKET",
    "INDEX_OPS",
    "MAX_FDS_PER_FRAME",
    "callable_name",
    "close_all",
    "error_reply",
    "load_callable",
    "raise_reply_error",
    "recv_exact",
    "recv_frame",
    "recv_plain_frame",
    "send_frame",
]

DEFAULT_SOCKET = "/var/run/shardcache/endpoint.sock"  # the chart's hostPath mount
MAX_FRAME_BYTES = 64 * 2**20  # a frame is control JSON; chunk bytes never travel in it
MAX_FDS_PER_FRAME = 128  # below SCM_MAX_FD (253); a larger request is split
_LENGTH = struct.Struct(">I")
INDEX_OPS = (
    "register",
    "register_change",
    "generation",
    "invalidate",
    "record_rank",
    "entries",
)


def send_frame(
    sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()
) -> None:
    """Send one length-prefixed JSON frame, with ``fds`` attached (``SCM_RIGHTS``)."""
    body = json.dumps(message, separators=(",", ":")).encode()
    data = _LENGTH.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


def recv_frame(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """Read one frame and the descriptors that came with it.

    Raises:
        EOFError: the peer closed the connection.
        ValueError: the frame is larger than ``MAX_FRAME_BYTES`` or not JSON.
    """
    buf = bytearray()
    fds: list[int] = []
    need = _LENGTH.size
    while len(buf) < need:
        data, got, flags, _ = socket.recv_fds(sock, need - len(buf), MAX_FDS_PER_FRAME)
        fds.extend(got)
        if flags & getattr(socket, "MSG_CTRUNC", 0):
            close_all(fds)
            raise ValueError("descriptors were truncated (more than the frame limit)")
        if not data:
            close_all(fds)
            raise EOFError("connection closed")
        buf += data
        if need == _LENGTH.size and len(buf) >= need:
            (length,) = _LENGTH.unpack(bytes(buf[: _LENGTH.size]))
            if length > MAX_FRAME_BYTES:
                close_all(fds)
                raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
            need = _LENGTH.size + length
    return json.loads(bytes(buf[_LENGTH.size :])), fds


def recv_plain_frame(sock: socket.socket) -> dict[str, Any]:
    """Read one frame from a socket that carries no descriptors (TCP, TLS).

    Raises:
        EOFError: the peer closed the connection.
        ValueError: the frame is larger than ``MAX_FRAME_BYTES`` or not JSON.
    """
    head = bytearray(_LENGTH.size)
    recv_exact(sock, memoryview(head))
    (length,) = _LENGTH.unpack(head)
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"frame of {length} bytes exceeds {MAX_FRAME_BYTES}")
    body = bytearray(length)
    recv_exact(sock, memoryview(body))
    message = json.loads(body)
    if not isinstance(message, dict):
        raise ValueError("a frame must hold a JSON object")
    return message


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``recv_into``: no intermediate copy).

    Raises:
        EOFError: the peer closed the connection before ``view`` was full.
    """
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise EOFError(f"connection closed after {got} of {len(view)} bytes")
        got += n


def close_all(fds: Sequence[int]) -> None:
    for fd in fds:
        os.close(fd)


def raise_reply_error(reply: dict[str, Any]) -> None:
    """Re-raise an error the endpoint reported as the project's own type."""
    err = reply.get("error")
    if not err:
        return
    raise errors.error_type(str(err.get("type")))(str(err.get("message")))


def error_reply(exc: errors.ShardCacheError) -> dict[str, Any]:
    """The reply that carries ``exc`` to the rank (:func:`raise_reply_error`)."""
    return {"error": {"type": type(exc).__name__, "message": str(exc)}}


def callable_name(fn: Callable[..., Any] | None, label: str) -> str | None:
    """``module:qualname`` of a module-level function, which the cache worker imports.

    A process outside Ray cannot ship code to the cluster (the socket carries
    no pickle), so preprocess and target must be importable on the cache
    worker's image; the worker checks the fingerprint matches.

    >>> from shardcache.decoders import raw_bytes
    >>> callable_name(raw_bytes, "preprocess")
    'shardcache.decoders:raw_bytes'

    Raises:
        ConfigError: ``fn`` is a lambda, a closure, a partial or defined in
            ``__main__``.
    """
    if fn is None:
        return None
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if not module or module in ("__main__", "__mp_main__") or "<" in qualname:
        raise ConfigError(
            f"{label} {qualname or fn!r} must be a module-level function of a module "
            "that the cache worker's image can import (the node-local endpoint takes it "
            "by name, never as pickled code); move it out of the script."
        )
    try:
        found = _import(module, qualname)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(
            f"{label} {module}:{qualname} is not importable: {exc}"
        ) from exc
    if found is not fn:
        raise ConfigError(f"{label} {module}:{qualname} does not name {fn!r}.")
    return f"{module}:{qualname}"


def _import(module: str, qualname: str) -> Any:
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def load_callable(name: str, fp: str, label: str) -> Callable[..., Any]:
    """The function ``module:qualname`` on this side, checked against ``fp``.

    Raises:
        ConfigError: not importable, or its code differs from the rank's.
    """
    module, _, qualname = name.partition(":")
    try:
        found = _import(module, qualname)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(
            f"the cache worker cannot import {label} {name}: {exc}. Install the module "
            "in the cache worker's image."
        ) from exc
    # A dataset with version= names no code fingerprint: the user vouches.
    if fp and not fp.startswith("version:") and fingerprint(found) != fp:
        raise ConfigError(
            f"{label} {name} on the cache worker differs from the training pod's "
            "(fingerprints differ); run the same version of that module on both."
        )
    return found
