"""What one sample of each benchmark dataset is: its preprocess and its size.

Every system runs the same preprocess over the same bytes, so the ranks, the
systems and the single-process benchmarks all take it from here.
"""

from __future__ import annotations

import numpy as np

IMAGE_PX = 224  # the usual ImageNet crop: 150 KB of uint8 per sample
BLOB_BYTES = 4096
VALUE_BYTES = {"images": 3 * IMAGE_PX * IMAGE_PX, "blobs": BLOB_BYTES}  # per sample


def decode_resize(data: bytes) -> np.ndarray:
    """Decode + resize to a CHW uint8 array: real CPU per image (the JPEG set)."""
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        small = img.convert("RGB").resize((IMAGE_PX, IMAGE_PX))
    return np.ascontiguousarray(np.asarray(small, dtype=np.uint8).transpose(2, 0, 1))


def blob(data: bytes) -> np.ndarray:
    """The 4 KB set: per-sample overhead dominates."""
    return np.frombuffer(data, dtype=np.uint8).copy()


PREPROCESS = {"images": decode_resize, "blobs": blob}


def tar_image(sample: dict[str, bytes]) -> np.ndarray:
    """A WebDataset sample of the JPEG set (``{"jpg": bytes}``), decoded the same way."""
    return decode_resize(sample["jpg"])


def tar_blob(sample: dict[str, bytes]) -> np.ndarray:
    """A WebDataset sample of the 4 KB set (``{"bin": bytes}``)."""
    return blob(sample["bin"])


# The same preprocessing over the same bytes, packed in tar shards.
PREPROCESS_TAR = {"images": tar_image, "blobs": tar_blob}
