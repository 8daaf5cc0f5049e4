"""Ready-made preprocess functions (bytes -> array), deterministic and picklable.

>>> import numpy as np
>>> raw_bytes(b"ab").tolist()
[97, 98]
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = [
    "as_arrays",
    "decode_image",
    "decode_image_chw",
    "decode_npy",
    "raw_bytes",
]


def raw_bytes(data: bytes) -> np.ndarray:
    """The object's bytes as a uint8 array (the default preprocess)."""
    return np.frombuffer(data, dtype=np.uint8).copy()


def decode_npy(data: bytes) -> np.ndarray:
    """One ``.npy`` file as its array (the default for per-sample .npy objects).

    >>> buf = io.BytesIO(); np.save(buf, np.zeros((3, 2), np.float32))
    >>> decode_npy(buf.getvalue()).shape
    (3, 2)
    """
    return np.load(io.BytesIO(data), allow_pickle=False)


def decode_image(data: bytes) -> np.ndarray:
    """Decode a JPEG/PNG into an HWC uint8 RGB array."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"), dtype=np.uint8)


def decode_image_chw(data: bytes) -> np.ndarray:
    """Decode to CHW float32 in [0, 1], the layout a CNN takes."""
    return (
        np.ascontiguousarray(decode_image(data).transpose(2, 0, 1), dtype=np.float32)
        / 255.0
    )


def as_arrays(sample: Any, key: str = "") -> Any:
    """A packed sample as arrays, unchanged otherwise (the default preprocess of
    packed formats): bytes become uint8, strings their UTF-8 bytes, numbers
    0-d arrays, a dict (tar members, a Parquet row) a dict of them, and a
    tuple or list (what a map-style Dataset returns) fields ``"(0)"``,
    ``"(1)"``..., which the rank turns back into a tuple.

    >>> as_arrays({"cls": b"7", "n": 3})["n"].shape, sorted(as_arrays((1, 2)))
    ((), ['(0)', '(1)'])
    """
    if isinstance(sample, dict):
        return {str(k): _as_array(v) for k, v in sample.items()}
    if isinstance(sample, tuple | list):
        return {f"({i})": _as_array(v) for i, v in enumerate(sample)}
    return _as_array(sample)


def _as_array(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        return np.frombuffer(value, dtype=np.uint8).copy()
    if isinstance(value, str):
        return np.frombuffer(value.encode(), dtype=np.uint8).copy()
    if type(value).__module__.startswith("torch"):
        return value.detach().cpu().contiguous().numpy()
    return np.asarray(value)
