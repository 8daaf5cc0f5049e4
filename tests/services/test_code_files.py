"""code_files: a long-lived process tells that the user's module it imported
changed on disk (the build workers replace themselves on it)."""

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
