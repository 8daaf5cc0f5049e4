"""A stable fingerprint of a preprocessing callable.

The fingerprint is part of a dataset's version: change what the function
does (its code, the values it closes over or has bound, the globals it
reads) and the cache starts a new generation by itself. Equal code must give
equal fingerprints in every process and run, or a job never hits its cache
across runs; so the fingerprint is built from the compiled code, not from
``repr``s that hold memory addresses:

- functions: their bytecode, constants and the names they use (not the
  source text: a comment, a blank line or a renamed parameter or local
  variable changes no behaviour and resets nothing), plus their defaults,
  closure cells and the module globals they read, each described stably;
- values: plain values by ``repr``, containers element by element, numpy
  arrays (and tensors) by dtype, shape and a hash of their bytes, modules by
  name, classes by their methods' code, any other object by its type and
  its state (``__dict__`` / ``__slots__``), recursively.

A value with no stable description (its ``repr`` holds a memory address and
it has no state to read, e.g. a lock or a C extension's handle) is described
by its type alone, so the fingerprint stays stable across runs but cannot see
a change inside it; :func:`unstable_parts` names it and the dataset tells the
user once, at construction, to pass ``version=``.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import xxhash

__all__ = [
    "dataset_fingerprint",
    "fingerprint",
    "log_new_generation",
    "unstable_parts",
    "variants_fingerprint",
]

log = logging.getLogger("shardcache")

MAX_DEPTH = 6  # nesting followed into helpers and object state (cycles stop here)
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


class _Describer:
    """Describes a value as text that is equal in every process for equal
    behaviour; collects what it could only describe by address."""

    def __init__(self) -> None:
        self.unstable: list[str] = []
        self._seen: set[int] = set()

    def value(self, v: Any, where: str, depth: int = 0) -> str:
        if isinstance(v, _PLAIN):
            return repr(v)
        if depth > MAX_DEPTH:
            return f"<{_qualname(type(v))} deeper than {MAX_DEPTH}>"
        if id(v) in self._seen:  # a cycle or a shared object: named once
            return f"<seen {_qualname(type(v))}>"
        self._seen.add(id(v))
        try:
            return self._compound(v, where, depth + 1)
        finally:
            self._seen.discard(id(v))

    def _compound(self, v: Any, where: str, depth: int) -> str:
        if isinstance(v, (list, tuple)):
            inner = ",".join(self.value(x, where, depth) for x in v)
            return f"{type(v).__name__}[{inner}]"
        if isinstance(v, (set, frozenset)):
            return (
                "set{" + ",".join(sorted(self.value(x, where, depth) for x in v)) + "}"
            )
        if isinstance(v, dict):
            items = sorted(
                f"{self.value(k, where, depth)}:{self.value(x, where, depth)}"
                for k, x in v.items()
            )
            return "dict{" + ",".join(items) + "}"
        array = _array_bytes(v)
        if array is not None:
            return array
        if isinstance(v, types.ModuleType):
            return f"module:{v.__name__}"
        if isinstance(v, type):
            return self._class(v, where, depth)
        if callable(v) and not _has_plain_repr(v):
            return self.callable(v, where, depth)
        return self._object(v, where, depth)

    def _object(self, v: Any, where: str, depth: int) -> str:
        if isinstance(v, logging.Logger):
            # Its caches fill as the process logs: by name, or ranks that
            # logged differently before building the dataset would disagree.
            return f"logger:{v.name}"
        state = _state(v)
        if state is not None and _is_runtime_machinery(type(v)):
            # Threads, handlers, executors, queues: state that moves while
            # the process runs says nothing about the data.
            return f"{_qualname(type(v))}:<runtime>"
        text = repr(v)
        if state is None:
            if " at 0x" in text:
                self.unstable.append(f"{where}: {_qualname(type(v))}")
            # By type only: stable across runs, blind to what changes inside.
            return (
                f"{_qualname(type(v))}:{text if ' at 0x' not in text else '<opaque>'}"
            )
        fields = ",".join(
            f"{k}={self.value(x, f'{where}.{k}', depth)}"
            for k, x in sorted(state.items())
        )
        return f"{_qualname(type(v))}({fields})"

    def _class(self, cls: type, where: str, depth: int) -> str:
        if cls.__module__ == "builtins" or not _is_user_code(cls):
            return f"class:{_qualname(cls)}"
        methods = ",".join(
            f"{k}={self.value(m, f'{where}.{k}', depth)}"
            for k, m in sorted(vars(cls).items())
            if not k.startswith("__") or k in ("__call__", "__init__", "__getitem__")
        )
        return f"class:{_qualname(cls)}({methods})"

    def callable(self, fn: Any, where: str, depth: int = 0) -> str:
        if isinstance(fn, functools.partial):
            args = ",".join(self.value(a, where, depth) for a in fn.args)
            kwargs = ",".join(
                f"{k}={self.value(v, where, depth)}"
                for k, v in sorted(fn.keywords.items())
            )
            inner = self.callable(fn.func, where, depth + 1)
            return f"partial({inner};{args};{kwargs})"
        if inspect.ismethod(fn):
            owner = self.value(fn.__self__, f"{where}.__self__", depth)
            return f"method({self.callable(fn.__func__, where, depth + 1)};{owner})"
        if inspect.isfunction(fn):
            return self._function(fn, where, depth)
        if inspect.isbuiltin(fn) or not _is_user_code(type(fn)):
            # numpy ufuncs, builtins, library callables: their name is their code
            name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
            module = getattr(fn, "__module__", None) or type(fn).__module__
            if name is None:
                return self._object(fn, where, depth)
            return f"callable:{module}.{name}"
        # A callable instance of the user's class: its class's code and its state.
        cls = self._class(type(fn), where, depth)
        return f"{cls}|{self._object(fn, where, depth)}"

    def _function(self, fn: types.FunctionType, where: str, depth: int) -> str:
        name = f"{fn.__module__}.{fn.__qualname__}"
        parts = [name, _code(fn.__code__)]
        if fn.__defaults__:
            parts.append(
                "defaults="
                + ",".join(self.value(d, where, depth) for d in fn.__defaults__)
            )
        if fn.__kwdefaults__:
            parts.append(
                "kwdefaults="
                + ",".join(
                    f"{k}={self.value(v, where, depth)}"
                    for k, v in sorted(fn.__kwdefaults__.items())
                )
            )
        if fn.__closure__:
            cells = []
            for var, cell in zip(fn.__code__.co_freevars, fn.__closure__, strict=True):
                try:
                    contents = cell.cell_contents
                except ValueError:  # an empty cell
                    cells.append(f"{var}=<empty>")
                    continue
                cells.append(
                    f"{var}={self.value(contents, f'{where} (closes over {var})', depth)}"
                )
            parts.append("closure=" + ",".join(cells))
        read = _globals_read(fn.__code__)
        for g in sorted(read):
            if g in fn.__globals__:
                value = fn.__globals__[g]
                parts.append(
                    f"global {g}={self.value(value, f'{where} (global {g})', depth)}"
                )
        return "\n".join(parts)


def _code(code: types.CodeType) -> str:
    """Bytecode, constants (nested code objects recursively) and the names
    used: not variable names, file names or line numbers."""
    consts = ",".join(
        _code(c) if isinstance(c, types.CodeType) else repr(c) for c in code.co_consts
    )
    return (
        f"code({code.co_argcount},{code.co_kwonlyargcount},{code.co_flags},"
        f"{code.co_code.hex()},[{consts}],{code.co_names})"
    )


# LOAD_FROM_DICT_OR_GLOBALS: a class body's or annotation scope's read (3.12+).
_GLOBAL_OPS = frozenset(
    (
        "LOAD_GLOBAL",
        "LOAD_NAME",
        "STORE_GLOBAL",
        "DELETE_GLOBAL",
        "LOAD_FROM_DICT_OR_GLOBALS",
    )
)


def _globals_read(code: types.CodeType) -> set[str]:
    """The global names ``code`` (and the functions, lambdas and
    comprehensions inside it) reads or writes. Not ``co_names``: that holds
    attribute names too, so ``x.copy()`` would make a module-level ``import
    copy`` part of the function, and adding that import would start a new
    generation (a README trial saw all 50 objects read again).

    >>> import copy  # noqa: F401 (the global the attribute must not match)
    >>> sorted(_globals_read((lambda x: [len(y.copy()) for y in x]).__code__))
    ['len']
    """
    names = {
        str(i.argval) for i in dis.get_instructions(code) if i.opname in _GLOBAL_OPS
    }
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _globals_read(c)
    return names


def _array_bytes(v: Any) -> str | None:
    module = type(v).__module__.split(".")[0]
    if module == "torch" and hasattr(v, "detach") and hasattr(v, "numpy"):
        v = v.detach().cpu().numpy()
        module = "numpy"
    if module == "numpy" and hasattr(v, "dtype") and hasattr(v, "tobytes"):
        import numpy as np

        a = np.ascontiguousarray(v)
        if a.dtype.hasobject:
            return None
        digest = xxhash.xxh3_64_hexdigest(memoryview(a).cast("B") if a.size else b"")
        return f"ndarray({a.dtype.str},{a.shape},{digest})"
    return None


def _state(v: Any) -> dict[str, Any] | None:
    state: dict[str, Any] = {}
    found = False
    if hasattr(v, "__dict__") and isinstance(vars(v), dict):
        state.update(vars(v))
        found = True
    for cls in type(v).__mro__:
        for slot in getattr(cls, "__slots__", ()) or ():
            if isinstance(slot, str) and hasattr(v, slot) and slot != "__dict__":
                state[slot] = getattr(v, slot)
                found = True
    return state if found else None


def _has_plain_repr(v: Any) -> bool:
    return type(v).__repr__ is not object.__repr__ and " at 0x" not in repr(v)


def _is_user_code(cls: type) -> bool:
    module = cls.__module__.split(".")[0]
    return module not in ("builtins", "numpy", "torch", "functools", "ray")


_RUNTIME_MODULES = (
    "threading",
    "_thread",
    "logging",
    "multiprocessing",
    "queue",
    "concurrent",
    "asyncio",
    "socket",
    "ssl",
    "io",
    "_io",
    "weakref",
)


def _is_runtime_machinery(cls: type) -> bool:
    """Process machinery whose state changes as the process runs (never data)."""
    return cls.__module__.split(".")[0] in _RUNTIME_MODULES


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _describe(fn: Callable[..., Any] | None, label: str) -> tuple[str, list[str]]:
    if fn is None:
        return "identity", []
    d = _Describer()
    return d.callable(fn, label), d.unstable


def fingerprint(fn: Callable[..., Any] | None) -> str:
    """Return a 16-hex-digit fingerprint of ``fn``: equal for equal behaviour
    in every process (see the module docstring).

    >>> def scale(b, factor=2): return b
    >>> fingerprint(scale) == fingerprint(scale)
    True
    >>> fingerprint(functools.partial(scale, factor=3)) != fingerprint(scale)
    True
    """
    text, _ = _describe(fn, "preprocess")
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def unstable_parts(fn: Callable[..., Any] | None, label: str) -> list[str]:
    """What in ``fn`` has no stable description (named ``label``, e.g.
    ``"preprocess (closes over lock)"``); empty when the fingerprint is stable.

    >>> import threading
    >>> lock = threading.Lock()
    >>> unstable_parts(lambda b: (lock, b)[1], "preprocess")
    ['preprocess (global lock): _thread.lock']
    """
    return _describe(fn, label)[1]


def dataset_fingerprint(
    preprocess: Callable[..., Any] | None,
    target: Callable[..., Any] | None = None,
    version: str | None = None,
) -> str:
    """The fingerprint a dataset's generation follows: ``preprocess``'s and
    ``target``'s, or the user's ``version`` (then code changes reset nothing
    until the version does). Warns once (logger ``shardcache``) when a part
    has no stable description, since such a fingerprint changes every run.
    """
    if version is not None:
        return f"version:{version}"
    fp = fingerprint(preprocess)
    if target is not None:
        fp += f"+target:{fingerprint(target)}"
    unstable = unstable_parts(preprocess, "preprocess") + (
        unstable_parts(target, "target") if target is not None else []
    )
    if unstable:
        log.warning(
            "the cache can fingerprint %s only by its type (it has no state to "
            "read, only a memory address), so a change inside it will not start a "
            "new cache generation. Pass version='...' to DistributedCachedDataset "
            "and change it whenever the preprocessing changes.",
            "; ".join(unstable),
        )
    return fp


def variants_fingerprint(augment: Callable[..., Any], seed: int) -> str:
    """The version of a dataset's augmented variants: ``augment``'s fingerprint
    and the seed its generators derive from (16 hex digits).

    It versions the variant chunks only, not the dataset's generation: the
    base form does not depend on ``augment``, so changing it rebuilds the
    variants from the cached base and reads nothing from the source. ``K``
    is not part of it: variant ``v`` is the same view whatever ``K`` is
    (its generator depends on ``v``, not ``K``), so raising ``K`` keeps the
    variants already built.

    >>> def flip(x, rng): return x[::-1]
    >>> variants_fingerprint(flip, 0) == variants_fingerprint(flip, 0)
    True
    >>> variants_fingerprint(flip, 0) != variants_fingerprint(flip, 1)
    True
    """
    text = f"{fingerprint(augment)}/seed:{int(seed)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _changes(previous: str, current: str, fns: dict[str, Any]) -> list[str]:
    """What differs between two dataset fingerprints, in words."""
    if previous.startswith("version:") or current.startswith("version:"):
        old = (
            previous.removeprefix("version:")
            if previous.startswith("version:")
            else None
        )
        new = (
            current.removeprefix("version:") if current.startswith("version:") else None
        )
        return [f"version {old!r} -> {new!r}"]
    old_pre, _, old_target = previous.partition("+target:")
    new_pre, _, new_target = current.partition("+target:")
    out = []
    if old_pre != new_pre:
        name = getattr(fns.get("preprocess"), "__qualname__", "preprocess")
        out.append(
            f"preprocess {name} (its code, bound values or the globals it reads) "
            f"{old_pre} -> {new_pre}"
        )
    if old_target != new_target:
        name = getattr(fns.get("target"), "__qualname__", "target")
        if not old_target or not new_target:
            out.append("target " + ("added" if new_target else "removed"))
        else:
            out.append(f"target {name} {old_target} -> {new_target}")
    return out or [f"fingerprint {previous} -> {current}"]


def log_new_generation(
    name: str,
    previous: str,
    current: str,
    generation: int,
    manifest: Any,
    fns: dict[str, Any],
) -> None:
    """The one line the rank that started a new generation logs (WARNING,
    logger ``shardcache``): what changed, the generations, what is re-read."""
    log.warning(
        "dataset %r: %s; cache generation %d -> %d, so all %d objects (%.1f MiB) "
        "will be read from the source again. Pass version= to decide yourself "
        "when the cache starts over.",
        name,
        "; ".join(_changes(previous, current, fns)),
        generation - 1,
        generation,
        len(manifest),
        manifest.total_bytes / 2**20,
    )
