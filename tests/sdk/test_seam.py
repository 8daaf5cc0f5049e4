"""The seam: the sdk imports no cluster code and starts stores through one hook."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardcache
from shardcache.errors import ConfigError
from shardcache.starters import known_starters, store_starter

SDK = Path(shardcache.__file__).parent


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_seam_no_sdk_module_imports_shardcache_server():
    offenders = {
        str(path.relative_to(SDK)): sorted(
            m for m in _imported_modules(path) if m.split(".")[0] == "shardcache_server"
        )
        for path in sorted(SDK.rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_seam_importing_every_sdk_module_leaves_shardcache_server_unloaded():
    # A fresh interpreter: this test process may have loaded it already.
    code = (
        "import importlib, json, pkgutil, sys\n"
        "import shardcache\n"
        "for m in pkgutil.walk_packages(shardcache.__path__, 'shardcache.'):\n"
        "    importlib.import_module(m.name)\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.split('.')[0] == 'shardcache_server')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ.copy(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


def test_seam_start_hook_is_one_named_entry_with_an_install_hint():
    assert list(known_starters()) == ["ray"]
    entry = known_starters()["ray"]
    assert entry["class"].startswith("shardcache_server.") and "Install" in entry["err"]
    with pytest.raises(TypeError):
        known_starters()["other"] = {}  # type: ignore[index]


def test_seam_start_hook_resolves_to_the_cluster_side():
    from shardcache_server.cluster import ensure_stores_for

    assert store_starter("ray") is ensure_stores_for


def test_seam_unknown_starter_lists_the_known_ones():
    with pytest.raises(ConfigError, match="no store starter named 'k8s'.*ray"):
        store_starter("k8s")


def test_seam_missing_cluster_side_says_what_to_install(monkeypatch):
    from shardcache import starters

    monkeypatch.setitem(
        starters._STARTERS,
        "ray",
        {**starters._STARTERS["ray"], "class": "shardcache_no_such_pkg.cluster.f"},
    )
    with pytest.raises(ConfigError, match="Install shardcache\\[server\\]") as err:
        store_starter("ray")
    assert isinstance(err.value.__cause__, ImportError)


def _module_files(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file for every module under ``root`` (named ``package``)."""
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([package, *parts] if package else parts)] = path
    return out


def _import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (anywhere in it:
    a lazy import inside a function is an arrow too)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_pkg = path.name == "__init__.py"
        here = name if is_pkg else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(filter(None, [*up, base]))
                for alias in node.names:  # a submodule, else the module itself
                    sub = f"{base}.{alias.name}" if base else alias.name
                    targets.add(sub if sub in modules else base)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.parametrize("tree", ["sdk/shardcache", "services/shardcache_server", "bench"])
def test_seam_no_import_circles_between_modules(tree):
    # Arrows point one way inside each tree (docs/architecture.md, "Map"): a
    # package's __init__ re-exporting its modules is the one allowed loop.
    root = Path(__file__).resolve().parents[2] / tree
    package = "" if tree == "bench" else root.name
    modules = _module_files(root, package)
    graph = _import_graph(modules)
    for name, path in modules.items():
        if path.name == "__init__.py":  # re-exports: not an arrow back up
            for child in list(graph[name]):
                graph[name].discard(child)
    assert _circles(graph) == []
