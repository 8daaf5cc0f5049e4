"""Checking at construction that the user's callables can travel to the cluster.

``preprocess`` and ``target`` run in the stores' build workers, and
``transform`` in DataLoader worker processes: all of them are pickled (with
Ray's cloudpickle). A callable that cannot be pickled used to fail at the
first batch with Ray's raw ``TypeError``; checked here, the error names the
argument and the member that cannot travel (a closed-over lock, a bound
file handle) and the fix. The check pickles once per dataset (a few
microseconds for a plain function; as long as shipping it for large
closed-over objects).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from shardcache.errors import ConfigError

__all__ = ["check_picklable"]


def _dumps(value: Any) -> None:
    from ray import cloudpickle

    cloudpickle.dumps(value)


def _members(fn: Any) -> Iterator[tuple[str, Any]]:
    """``(how it is reached, value)`` of what pickling ``fn`` pickles with it."""
    if isinstance(fn, functools.partial):
        yield "its partial function", fn.func
        for i, a in enumerate(fn.args):
            yield f"partial argument {i}", a
        for k, v in fn.keywords.items():
            yield f"partial argument {k}=", v
        return
    func = getattr(fn, "__func__", fn)
    if inspect.ismethod(fn):
        yield "the object it is bound to", fn.__self__
    if inspect.isfunction(func):
        code = func.__code__
        for var, cell in zip(code.co_freevars, func.__closure__ or (), strict=False):
            try:
                yield f"the variable {var!r} it closes over", cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for i, d in enumerate(func.__defaults__ or ()):
            yield f"default argument {i}", d
        for k, d in (func.__kwdefaults__ or {}).items():
            yield f"default argument {k}=", d
        for g in code.co_names:
            if g in func.__globals__:
                yield f"the global {g!r} it reads", func.__globals__[g]
        return
    for k, v in getattr(fn, "__dict__", {}).items():
        yield f"its attribute {k!r}", v


def check_picklable(fn: Callable[..., Any] | None, label: str) -> None:
    """Raise ``ConfigError`` naming ``label`` and the offending member if
    ``fn`` cannot be pickled; return quietly if it can.

    Raises:
        ConfigError: ``fn`` cannot be pickled.

    >>> import threading
    >>> lock = threading.Lock()
    >>> check_picklable(lambda b: b, "preprocess")
    >>> check_picklable(lambda b: (lock, b)[1], "preprocess")
    Traceback (most recent call last):
    ...
    shardcache.errors.ConfigError: preprocess cannot be pickled: the global 'lock' it reads (a _thread.lock) cannot be pickled (TypeError: cannot pickle '_thread.lock' object). preprocess is pickled to run on the cluster: create that object inside the function (or lazily on its first call) instead of closing over it.
    """
    if fn is None:
        return
    try:
        _dumps(fn)
    except Exception as exc:  # any pickling failure: find and name the member
        culprit = "it"
        for how, value in _members(fn):
            try:
                _dumps(value)
            except Exception:  # this member is one that fails
                culprit = (
                    f"{how} (a {type(value).__module__}.{type(value).__qualname__})"
                )
                break
        raise ConfigError(
            f"{label} cannot be pickled: {culprit} cannot be pickled "
            f"({type(exc).__name__}: {exc}). {label} is pickled to run on the "
            "cluster: create that object inside the function (or lazily on its "
            "first call) instead of closing over it."
        ) from exc
