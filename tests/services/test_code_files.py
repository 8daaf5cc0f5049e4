"""code_files: a long-lived process tells that the user's module it imported
changed on disk (the build workers replace themselves on it); and what else a
long-lived build process keeps stays bounded."""

from __future__ import annotations

import importlib
import os
import sys

from shardcache_server.code_files import changed_modules


def test_an_edited_user_module_is_named_and_installed_ones_are_not(tmp_path):
    module = tmp_path / "user_decode_mod.py"
    module.write_text("OFFSET = 0\n")
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("user_decode_mod")
        assert "user_decode_mod" not in changed_modules()  # first seen: as loaded
        module.write_text("OFFSET = 100\n")
        later = os.stat(module).st_mtime_ns + 1_000_000_000
        os.utime(module, ns=(later, later))  # an edit within the clock's tick
        assert "user_decode_mod" in changed_modules()
        assert "numpy" not in changed_modules() and "json" not in changed_modules()
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("user_decode_mod", None)


def test_a_long_lived_build_process_keeps_a_bounded_number_of_fetchers():
    # A build actor lives as long as the node; storage_options that rotate
    # (temporary credentials) each make a new key.
    from shardcache_server import builder
    from shardcache_server.settings import ServiceSettings

    settings = ServiceSettings()
    first = builder._fetcher(settings, "file", {"token": "0"})
    for i in range(1, 3 * builder.FETCHERS_KEPT):
        builder._fetcher(settings, "file", {"token": str(i)})
    assert len(builder._FETCHERS) <= builder.FETCHERS_KEPT
    assert builder._fetcher(settings, "file", {"token": "0"}) is not first
    again = builder._fetcher(settings, "file", {"token": "x"})
    assert builder._fetcher(settings, "file", {"token": "x"}) is again  # reused
