"""Local .npy files read straight into the chunk's column: the same chunk as the
general build, and the general build's answer for every member it does not model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardcache.checksum import is_intact
from shardcache.chunks import ERRORS, FAILED, Chunk
from shardcache.decoders import decode_npy
from shardcache.errors import PreprocessError
from shardcache.manifest import Manifest
from shardcache_server.builder import BuildRequest, build_members
from shardcache_server.npy_rows import read_npy_column
from shardcache_server.settings import ServiceSettings


def _files(folder: Path, arrays: list[np.ndarray]) -> list[Path]:
    paths = []
    for i, a in enumerate(arrays):
        path = folder / f"{i:03d} ü%.npy"  # unusual characters are plain paths here
        np.save(path, a)
        paths.append(path)
    return paths


def _build(paths: list[Path], preprocess=decode_npy, target=None, sizes=None):
    sizes = sizes or [p.stat().st_size for p in paths]
    manifest = Manifest.from_entries(
        "file", [f"file://{p}" for p in paths], sizes, ["e"] * len(paths)
    )
    req = BuildRequest(
        dataset="d",
        protocol="file",
        storage_options={},
        manifest=manifest.to_object(),
        lo=0,
        hi=len(paths),
        preprocess=preprocess,
        target=target,
    )
    return build_members(ServiceSettings(), req)


def _general(data: bytes) -> np.ndarray:
    return decode_npy(data)  # the same decode, not the identical function


def test_a_chunk_read_into_its_column_equals_the_general_build(tmp_path):
    rng = np.random.default_rng(0)
    arrays = [rng.integers(0, 255, (3, 8, 8), dtype=np.uint8) for _ in range(7)]
    paths = _files(tmp_path, arrays)
    assert read_npy_column([(f"file://{p}", "", p.stat().st_size) for p in paths]) is not None
    fast, report = _build(paths, target=lambda url: len(url))
    slow, slow_report = _build(paths, preprocess=_general, target=lambda url: len(url))
    assert sorted(fast) == sorted(slow)
    for name in fast:
        assert np.array_equal(fast[name], slow[name]), name
        assert fast[name].dtype == slow[name].dtype, name
    assert is_intact(fast)
    assert report["reads"] == 7 and report["bytes_read"] == slow_report["bytes_read"]
    assert report["bytes_read"] == sum(p.stat().st_size for p in paths)
    chunk = Chunk(fast)
    assert np.array_equal(chunk.sample(5), arrays[5])


@pytest.mark.parametrize(
    "case",
    ["another shape", "another dtype", "fortran order", "a long header", "a 1-d file"],
)
def test_files_the_fast_path_does_not_model_get_the_general_answer(tmp_path, case):
    arrays = [np.arange(24, dtype=np.int32).reshape(2, 3, 4) + i for i in range(4)]
    if case == "another shape":
        arrays[2] = np.arange(12, dtype=np.int32).reshape(1, 3, 4)
    elif case == "another dtype":
        arrays[1] = arrays[1].astype(np.int64)
    elif case == "fortran order":
        arrays = [np.asfortranarray(a) for a in arrays]
    elif case == "a long header":  # a structured dtype whose header passes 128 bytes
        dtype = np.dtype([(f"field_{i:02d}", np.int16) for i in range(12)])
        arrays = [np.zeros(3, dtype=dtype) for _ in range(4)]
    else:
        arrays = [np.arange(5, dtype=np.float32) * i for i in range(4)]
    paths = _files(tmp_path, arrays)
    if case in ("a long header", "a 1-d file"):
        assert read_npy_column([(f"file://{p}", "", p.stat().st_size) for p in paths]) is not None
    else:
        assert read_npy_column([(f"file://{p}", "", p.stat().st_size) for p in paths]) is None
    if case == "another dtype":  # the general build's own refusal, naming both files
        with pytest.raises(PreprocessError, match="share dtype"):
            _build(paths)
        return
    fast, _ = _build(paths)
    slow, _ = _build(paths, preprocess=_general)
    assert sorted(fast) == sorted(slow)
    for name in fast:
        assert np.array_equal(fast[name], slow[name]), name
    chunk = Chunk(fast)
    for i, a in enumerate(arrays):
        assert np.array_equal(chunk.sample(i), a)


def test_a_missing_or_changed_file_is_reported_as_the_general_build_does(tmp_path):
    arrays = [np.full((4, 4), i, np.uint8) for i in range(5)]
    paths = _files(tmp_path, arrays)
    sizes = [p.stat().st_size for p in paths]
    paths[1].unlink()
    np.save(paths[3], np.full((5, 5), 3, np.uint8))  # rewritten since it was listed
    columns, report = _build(paths, sizes=sizes)
    errors = json.loads(bytes(columns[ERRORS]).decode())
    assert sorted(errors) == ["1", "3"]
    assert errors["1"][0] == "SourceNotFound" and errors["3"][0] == "CorruptObjectError"
    assert columns[FAILED].tolist() == [False, True, False, True, False]
    assert report["reads"] == 3
    chunk = Chunk(columns)
    assert np.array_equal(chunk.sample(4), arrays[4])
