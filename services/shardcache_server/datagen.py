"""Generated datasets for the demo, tests and benchmarks (no downloads)."""

from __future__ import annotations

import io
from typing import Any

import numpy as np

__all__ = ["make_image", "upload_blobs", "upload_image_shards", "upload_images"]


def make_image(i: int, size: int = 32, fmt: str = "PNG", seed: int = 0) -> bytes:
    """A deterministic RGB image whose colour encodes its class (``i % 10``)."""
    from PIL import Image

    rng = np.random.default_rng([seed, i])
    label = i % 10
    base = np.zeros((size, size, 3), dtype=np.uint8)
    base[..., label % 3] = 40 + 20 * label
    noise = rng.integers(0, 60, size=(size, size, 3), dtype=np.uint8)
    img = Image.fromarray(
        np.clip(base.astype(np.int16) + noise, 0, 255).astype(np.uint8)
    )
    buf = io.BytesIO()
    img.save(buf, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


def upload_images(
    fs: Any, prefix: str, count: int, *, size: int = 32, fmt: str = "PNG", seed: int = 0
) -> list[str]:
    """Write ``count`` images under ``prefix`` (an fsspec path); returns their paths."""
    ext = "png" if fmt == "PNG" else "jpg"
    paths = [f"{prefix.rstrip('/')}/img-{i:06d}-c{i % 10}.{ext}" for i in range(count)]
    fs.pipe({p: make_image(i, size, fmt, seed) for i, p in enumerate(paths)})
    return paths


def upload_blobs(
    fs: Any, prefix: str, count: int, nbytes: int, seed: int = 0
) -> list[str]:
    """Write ``count`` random blobs of ``nbytes`` each under ``prefix``."""
    rng = np.random.default_rng(seed)
    paths = [f"{prefix.rstrip('/')}/blob-{i:06d}.bin" for i in range(count)]
    fs.pipe({p: rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() for p in paths})
    return paths


def upload_image_shards(
    fs: Any, prefix: str, count: int, *, per_shard: int = 500, size: int = 32
) -> list[str]:
    """Write ``count`` PNG images as WebDataset tar shards under ``prefix``:
    members ``img-000123-c7.png`` and ``img-000123-c7.cls`` per sample."""
    import tarfile

    shards = {}
    for s, start in enumerate(range(0, count, per_shard)):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for i in range(start, min(start + per_shard, count)):
                stem = f"img-{i:06d}-c{i % 10}"
                for ext, data in (
                    ("png", make_image(i, size)),
                    ("cls", str(i % 10).encode()),
                ):
                    info = tarfile.TarInfo(f"{stem}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards[f"{prefix.rstrip('/')}/train-{s:04d}.tar"] = buf.getvalue()
    fs.pipe(shards)
    return sorted(shards)
