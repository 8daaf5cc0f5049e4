"""Which module files are installed code (Python's library, site-packages) and which are the user's.

The user's code is what a long-lived cache process must not take by name:
a preprocess from the user's ``decode.py`` is shipped by value, so the
stores and build processes run exactly the code the rank fingerprinted
(``transport/direct.py``), and a build process checks the user's files it
loaded before each build (``shardcache_server.code_files``). Installed code
changes with an install, which restarts the cluster anyway.
"""

from __future__ import annotations

import os
import site
import sysconfig

__all__ = ["INSTALLED_ROOTS", "is_installed"]


def _installed_roots() -> tuple[str, ...]:
    # The library folders, not the prefixes: a system Python's prefix is
    # /usr, and user code under /usr/src/app (a container's WORKDIR) is not
    # installed code.
    paths = sysconfig.get_paths()
    roots = {paths.get(k, "") for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages())
    roots.add(site.getusersitepackages())
    return tuple(sorted(os.path.join(r, "") for r in roots if r))


INSTALLED_ROOTS = _installed_roots()


def is_installed(path: str) -> bool:
    """Whether a module file belongs to Python's library or an installed package.

    >>> import json, numpy
    >>> is_installed(json.__file__), is_installed(numpy.__file__)
    (True, True)
    >>> is_installed("/home/me/train/decode.py")
    False
    """
    return path.startswith(INSTALLED_ROOTS)
