"""Ready-made preprocess functions (bytes -> array), deterministic and picklable.

>>> import numpy as np
>>> raw_bytes(b"ab").tolist()
[97, 98]
"""

from __future__ import annotations

import io

import numpy as np

__all__ = ["decode_image", "decode_image_chw", "raw_bytes"]


def raw_bytes(data: bytes) -> np.ndarray:
    """The object's bytes as a uint8 array (the default preprocess)."""
    return np.frombuffer(data, dtype=np.uint8).copy()


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
