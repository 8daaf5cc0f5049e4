"""The one place the sdk reaches into the cluster side: starting stores.

The sdk never imports ``shardcache_server``. In embedded mode (nobody
deployed stores) a rank still has to start them, so the code that does is
named here by a dotted path and imported only when it is called, like
fsspec's ``known_implementations``: a pod that reads through the endpoint or
Flight never loads the cluster side, and an sdk installed without it says
what to install instead of failing on an import at startup.

>>> sorted(known_starters())
['ray']
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from shardcache.errors import ConfigError

__all__ = ["StoreStarter", "known_starters", "store_starter"]

# (redis_url, namespace) -> {Ray node id: store actor handle}, one store per
# alive node, each answering ping.
StoreStarter = Callable[[str, str], dict[str, Any]]

# name -> {"class": dotted path of a StoreStarter, "err": what to do when it
# cannot be imported}. One entry: stores run as Ray actors.
_STARTERS: dict[str, dict[str, str]] = {
    "ray": {
        "class": "shardcache_server.cluster.ensure_stores_for",
        "err": "Install shardcache[server] (the cluster side) to start stores "
        "from a rank, or deploy the stores (helm/shardcache) and pass redis_url=.",
    },
}


def known_starters() -> Mapping[str, Mapping[str, str]]:
    """A read-only view of the registry: name -> ``{"class", "err"}``."""
    return MappingProxyType({k: MappingProxyType(v) for k, v in _STARTERS.items()})


def store_starter(name: str = "ray") -> StoreStarter:
    """Import and return the function registered as ``name``.

    Raises:
        ConfigError: ``name`` is not registered (the message lists the known
            names), or its module cannot be imported (the message says what to
            install, and the import error is the ``__cause__``).
    """
    entry = _STARTERS.get(name)
    if entry is None:
        raise ConfigError(
            f"no store starter named {name!r}; known: {', '.join(sorted(_STARTERS))}."
        )
    module_name, _, attr = entry["class"].rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{entry['err']} ({type(exc).__name__}: {exc})") from exc
    starter: StoreStarter = getattr(module, attr)
    return starter
