"""Named preprocessors for the CLI and chart, and the checks every result passes.

A result is stored in the Ray object store as a numpy array or a dict of
arrays, so readers get zero-copy views. Object arrays are refused: they would
be pickled, and a cache must never hold pickles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from shardcache.decoders import decode_image, decode_image_chw, raw_bytes
from shardcache.errors import ConfigError, PreprocessError
from shardcache.packed_manifest import format_of

__all__ = ["PREPROCESSORS", "describe", "get_preprocessor", "run_preprocess"]


PREPROCESSORS: dict[str, Callable[[bytes], Any]] = {
    "raw": raw_bytes,
    "decode_image": decode_image,
    "decode_image_chw": decode_image_chw,
}


def get_preprocessor(name: str) -> Callable[[bytes], Any]:
    """Look up a named preprocessor.

    Raises:
        ConfigError: unknown name; the message lists the valid ones.
    """
    try:
        return PREPROCESSORS[name]
    except KeyError:
        raise ConfigError(
            f"unknown preprocess {name!r}; choose one of {', '.join(sorted(PREPROCESSORS))}."
        ) from None


def _to_array(
    value: Any, url: str, field: str = "", label: str = "preprocess"
) -> np.ndarray:
    where = f"{url!r}" + (f" field {field!r}" if field else "")
    if type(value).__module__.startswith("torch"):
        value = value.detach().cpu().contiguous().numpy()
    if not isinstance(value, np.ndarray):
        raise PreprocessError(
            f"{label} returned {type(value).__name__} for {where}; it must return a "
            "numpy array, a torch tensor, or a dict of them."
        )
    if value.dtype.hasobject:
        raise PreprocessError(
            f"{label} returned an object-dtype array for {where}; use a numeric dtype "
            "(object arrays would need pickling)."
        )
    # np.ascontiguousarray would turn a 0-d scalar into shape (1,)
    return value if value.flags.c_contiguous else np.ascontiguousarray(value)


def _container_hint(url: str, label: str) -> str:
    """A container file (tar, Parquet, HDF5, LMDB) listed by a prefix with a
    ``preprocess=`` is one sample of raw bytes: say how to read the samples
    inside, which is what a preprocess written for them expects.

    >>> print(_container_hint("s3://b/shards/a-0.tar", "preprocess").strip()[:45])
    (this 'tar' file is read whole, as one sample
    >>> _container_hint("s3://b/imgs/a.jpg", "preprocess")
    ''
    """
    found = format_of([url]) if label == "preprocess" else None
    if found is None:
        return ""
    return (
        f"\n(this {found!r} file is read whole, as one sample: a prefix lists "
        f"files, not the samples inside. Pass format={found!r}, or name the "
        f"files with a glob such as '.../*.{url.rsplit('.', 1)[-1]}', to read "
        "its samples)"
    )


def _pickle_hint(exc: Exception) -> str:
    """numpy advises ``allow_pickle`` for two things: bytes without the
    ``.npy`` magic (it takes them for a pickle) and a ``.npy`` of an object
    array; say which it was, and that nothing was unpickled.

    >>> import io
    >>> for data in (b"not an array", io.BytesIO()):
    ...     if not isinstance(data, bytes):
    ...         np.save(data, np.array([[1], "a"], dtype=object))
    ...         data = data.getvalue()
    ...     try:
    ...         np.load(io.BytesIO(data))
    ...     except ValueError as exc:
    ...         print(_pickle_hint(exc).strip()[:43])
    (the bytes are not a .npy array: numpy took
    (the .npy holds an object-dtype array, whic
    """
    text = str(exc)
    if "Object arrays cannot be loaded" in text:
        return (
            "\n(the .npy holds an object-dtype array, which only pickle can "
            "load, and nothing here unpickles: save it with a numeric dtype)"
        )
    # numpy 2: "This file contains pickled (object) data"; numpy 1: "Cannot
    # load file containing pickled data when allow_pickle=False".
    if "pickled" in text and "allow_pickle" in text:
        return (
            "\n(the bytes are not a .npy array: numpy took them for a pickle. "
            "Nothing was unpickled, and allow_pickle=True would run whatever "
            "the object holds: check the object, it is corrupt or not what it "
            "is named)"
        )
    return ""


def run_preprocess(
    fn: Callable[..., Any],
    data: Any,
    url: str,
    *extra: Any,
    label: str = "preprocess",
) -> np.ndarray | dict[str, np.ndarray]:
    """Run ``fn(data, *extra)`` on one object's bytes (or, for ``label="augment"``,
    one base sample and its generator) and normalise the result.

    Raises:
        PreprocessError: ``fn`` raised (the message names ``url``) or returned
            something that is not an array, tensor or dict of them.
    """
    try:
        value = fn(data, *extra)
    except Exception as exc:  # user code: any exception is the user's to see
        raise PreprocessError(
            f"{label} {getattr(fn, '__qualname__', fn)!r} raised {type(exc).__name__} "
            f"for {url!r}: {exc}{_pickle_hint(exc)}{_container_hint(url, label)}. "
            "Its row is kept as failed "
            "until the object changes; fix the object or the preprocess (a new "
            "preprocess is a new generation), or pass on_error='skip'."
        ) from exc
    if isinstance(value, dict):
        if not value or not all(isinstance(k, str) for k in value):
            raise PreprocessError(
                f"{label} returned a dict without string keys for {url!r}."
            )
        return {k: _to_array(v, url, k, label) for k, v in value.items()}
    return _to_array(value, url, label=label)


def describe(value: np.ndarray | dict[str, np.ndarray]) -> dict[str, Any]:
    """Shape, dtype and size of a stored value, for the index entry."""
    if isinstance(value, dict):
        return {
            "nbytes": int(sum(v.nbytes for v in value.values())),
            "shape": {k: list(v.shape) for k, v in value.items()},
            "dtype": {k: str(v.dtype) for k, v in value.items()},
        }
    return {
        "nbytes": int(value.nbytes),
        "shape": list(value.shape),
        "dtype": str(value.dtype),
    }
