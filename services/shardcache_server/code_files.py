"""Whether the user's code a long-lived process imported has changed on disk since.

A preprocess from the user's own module travels to the cache as code
(``shardcache.transport.direct``), but what that code imports travels by
name, and a build process imports it once: a build worker kept across
scripts would go on running the helper module it imported for the first
script after the user edited the file. The build worker asks
:func:`changed_modules` before each build and is replaced by a fresh
process when the answer is not empty.

Installed code (Python's own library, site-packages) is not watched: it
changes with an install, which restarts the cluster anyway. What is
watched is every other module file this process loaded (the user's
modules, and a checkout on ``PYTHONPATH``), one ``stat`` each per build.
"""

from __future__ import annotations

import os
import sys

from shardcache.code_paths import is_installed

__all__ = ["changed_modules"]


# A module file's modification time when this process first saw it loaded:
# the first build after the import (the build's own request imports it).
_SEEN: dict[str, int] = {}


def changed_modules() -> list[str]:
    """Names of the loaded, not installed modules whose file changed since
    this process first saw them (``[]``: the code it runs is the disk's).

    >>> changed_modules()
    []
    """
    changed = []
    for name, module in list(sys.modules.items()):
        try:
            path = getattr(module, "__file__", None)
        except Exception:  # a lazy module's __getattr__ may raise anything
            continue
        if not isinstance(path, str) or is_installed(path):
            continue
        try:
            mtime = os.stat(path).st_mtime_ns
        except OSError:  # a module whose file is gone: nothing to compare
            continue
        if _SEEN.setdefault(path, mtime) != mtime:
            changed.append(name)
    return changed
