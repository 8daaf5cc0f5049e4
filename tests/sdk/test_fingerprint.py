"""Fingerprints that depend on behaviour only, picklability at construction,
one reading of .npy URLs, and the one log line a new generation gets."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
import uuid

import numpy as np
import pytest

from shardcache.checksum import is_intact, seal
from shardcache.decoders import decode_npy
from shardcache.errors import ConfigError
from shardcache.fingerprint import (
    dataset_fingerprint,
    fingerprint,
    log_new_generation,
    unstable_parts,
)
from shardcache.index import RedisIndex
from shardcache.packed_manifest import format_of, objects_preprocess
from shardcache.picklability import check_picklable

SCRIPT = """
import numpy as np
from shardcache.fingerprint import fingerprint

class Normalize:
    def __init__(self):
        self.mean = np.arange(3.0)
        self.scale = {"a": [1, 2.5]}

MEAN = np.ones(3)

def make(norm):
    def preprocess(raw):
        return np.frombuffer(raw, np.uint8) * norm.scale["a"][1] + MEAN[0]
    return preprocess

print(fingerprint(make(Normalize())))
"""


def _run_script(tmp_path, source: str) -> str:
    path = tmp_path / f"s{uuid.uuid4().hex[:6]}.py"
    path.write_text(textwrap.dedent(source))
    done = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_fingerprint_of_closure_over_object_is_equal_across_processes(tmp_path):
    first, second = _run_script(tmp_path, SCRIPT), _run_script(tmp_path, SCRIPT)
    assert first == second and len(first) == 16
    changed_state = _run_script(tmp_path, SCRIPT.replace("[1, 2.5]", "[1, 3.5]"))
    changed_global = _run_script(tmp_path, SCRIPT.replace("np.ones(3)", "np.zeros(3)"))
    assert changed_state != first and changed_global != first


def test_fingerprint_ignores_comments_and_renamed_names_but_not_code(tmp_path):
    base = "def pre(data):\n    return data[:4]\nfrom shardcache.fingerprint import fingerprint\nprint(fingerprint(pre))\n"
    renamed = base.replace("(data)", "(raw)").replace("data[", "raw[")
    commented = base.replace("    return", "    # the header\n\n    return")
    other = base.replace("[:4]", "[:5]")
    fps = [_run_script(tmp_path, s) for s in (base, renamed, commented, other)]
    assert fps[0] == fps[1] == fps[2] != fps[3]


def test_fingerprint_names_what_has_no_stable_description(caplog):
    lock = threading.Lock()

    def pre(raw):
        with lock:
            return raw

    assert unstable_parts(pre, "preprocess") == [
        "preprocess (closes over lock): _thread.lock"
    ]
    assert fingerprint(pre) == fingerprint(pre)  # stable: by type only
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        dataset_fingerprint(pre)
    assert "pass version=" in caplog.text.lower() and "lock" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="shardcache"):
        assert dataset_fingerprint(pre, version="v2") == "version:v2"
    assert caplog.text == ""


def test_check_picklable_names_argument_and_member():
    lock = threading.Lock()
    check_picklable(lambda raw: raw[:3], "preprocess")
    with pytest.raises(
        ConfigError, match=r"target cannot be pickled: the variable 'lock'"
    ):
        check_picklable(lambda url: (lock, 1)[1], "target")


def test_register_change_reports_previous_fingerprint_once(redis_url, caplog):
    index = RedisIndex.from_url(redis_url, f"t{uuid.uuid4().hex[:8]}")
    assert index.register_change("ds", "s3://b/", "aaa", 3, 30) == (1, None)
    assert index.register_change("ds", "s3://b/", "aaa", 3, 30) == (1, None)
    assert index.register_change("ds", "s3://b/", "bbb", 3, 30) == (2, "aaa")
    assert index.register_change("ds", "s3://b/", "bbb", 3, 30) == (2, None)

    class _Manifest:
        total_bytes = 3 * 2**20

        def __len__(self):
            return 3

    with caplog.at_level(logging.WARNING, logger="shardcache"):
        log_new_generation("ds", "aaa", "bbb+target:ccc", 2, _Manifest(), {})
    (line,) = caplog.messages
    assert "preprocess" in line and "target added" in line
    assert "generation 1 -> 2" in line and "all 3 objects (3.0 MiB)" in line


def test_format_of_reads_npy_rows_only_for_a_single_file():
    assert format_of("/d/feats.npy") == "npy"
    assert format_of("/d/*.npy") is None and format_of(["/d/a.npy", "/d/b.npy"]) is None
    assert format_of("s3://b/train-*.tar") == "tar"
    listed = [f"s3://b/d/{i:03d}.npy" for i in range(5)]
    assert objects_preprocess(listed, "s3://b/d/") is decode_npy
    assert objects_preprocess(["s3://b/d/a.bin"], "s3://b/d/") is None
    with pytest.raises(ConfigError, match="format='tar'"):
        objects_preprocess(["s3://b/d/a.tar", "s3://b/d/b.tar"], "s3://b/d/")


def test_checksum_survives_a_chunk_file_round_trip(tmp_path):
    from shardcache.chunk_file import read_chunk_file, write_chunk_file

    cols = seal({"_": np.arange(12, dtype=np.float32).reshape(3, 4)})
    write_chunk_file(tmp_path / "c0", cols)
    back, _ = read_chunk_file(tmp_path / "c0")
    assert is_intact(back)


def test_an_import_the_function_never_reads_changes_nothing():
    """``b.copy()`` names the attribute ``copy``, not the module a script
    imports under that name: adding ``import copy`` (or ``import random``
    beside ``rng.random``) must not start a new generation. A global the
    function does read still does, in nested code too."""
    source = textwrap.dedent(
        """
        def pre(b):
            return [x.copy() for x in b] + [SCALE]
        """
    )

    def made(**module_globals):
        scope = {"__name__": "user_module", **module_globals}
        exec(source, scope)
        return fingerprint(scope["pre"])

    import copy

    assert made(SCALE=2) == made(SCALE=2, copy=copy)
    assert made(SCALE=2) != made(SCALE=3)  # read inside the comprehension
