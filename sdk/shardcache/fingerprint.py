"""A stable fingerprint of a preprocessing callable.

The fingerprint is part of a dataset's version: change the function's code, its
bound parameters or its name and the cache starts a new generation by itself.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["fingerprint"]


def _describe(value: Any, depth: int = 0) -> str:
    # repr() of plain values is stable; for callables recurse into their code.
    if callable(value) and depth < 3:
        return _callable_text(value, depth + 1)
    return repr(value)


def _callable_text(fn: Callable[..., Any], depth: int = 0) -> str:
    if isinstance(fn, functools.partial):
        args = ",".join(_describe(a, depth) for a in fn.args)
        kwargs = ",".join(
            f"{k}={_describe(v, depth)}" for k, v in sorted(fn.keywords.items())
        )
        return f"partial({_callable_text(fn.func, depth)};{args};{kwargs})"
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else type(fn)
    name = f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"
    try:
        source = inspect.getsource(target)
    except (OSError, TypeError):
        code = getattr(target, "__code__", None)
        source = code.co_code.hex() if code is not None else ""
    bound = ""
    func = getattr(fn, "__func__", fn)
    if inspect.isfunction(func):
        if func.__defaults__:
            bound += "defaults=" + ",".join(
                _describe(d, depth) for d in func.__defaults__
            )
        if func.__kwdefaults__:
            bound += "kwdefaults=" + ",".join(
                f"{k}={_describe(v, depth)}"
                for k, v in sorted(func.__kwdefaults__.items())
            )
        if func.__closure__:
            cells = []
            for cell in func.__closure__:
                try:
                    cells.append(_describe(cell.cell_contents, depth))
                except ValueError:  # empty cell
                    cells.append("<empty>")
            bound += "closure=" + ",".join(cells)
    if not inspect.isfunction(fn) and not inspect.ismethod(fn):
        state = getattr(fn, "__dict__", {})
        bound += "state=" + ",".join(
            f"{k}={_describe(v, depth)}" for k, v in sorted(state.items())
        )
    return f"{name}\n{source}\n{bound}"


def fingerprint(fn: Callable[..., Any] | None) -> str:
    """Return a 16-hex-digit fingerprint of ``fn`` (its name, source and bound values).

    >>> def scale(b, factor=2): return b
    >>> fingerprint(scale) == fingerprint(scale)
    True
    >>> fingerprint(functools.partial(scale, factor=3)) != fingerprint(scale)
    True
    """
    text = "identity" if fn is None else _callable_text(fn)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
