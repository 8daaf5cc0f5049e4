"""A weighted mixture's epoch as one global sequence: a pure function of
(component sizes, weights, seed, epoch), the same on every rank and at every
world size.

The interleave is deterministic, not sampled: component ``k``'s ``j``-th
draw is due at time ``(j + 1/2) / w_k`` and the sequence is every draw in
order of due time (ties by component). That is the stride scheduling of
Waldspurger and Weihl (Sainte-Laguë's divisor rule), so the proportions
hold in every window, not only on average: in any ``m`` consecutive
positions component ``k`` has ``w_k * m`` samples within
``1 + (K - 2) * w_k`` (``K``: components with a weight above zero; see
:func:`window_tolerance`). Each prefix is within half that: at a due time
``t`` every component has ``w_k * t`` draws within one half.

Which sample a draw reads: component ``k``'s draws walk a seeded permutation
of its samples; a component that runs out starts a new permutation (a new
pass), or, with ``on_exhausted="end_epoch"``, the epoch ends just before the
first draw that would repeat a sample.

Cost: one ``lexsort`` over the epoch's draws and one permutation per pass
of each component, all vectorised; 10 bytes a position (a component id and
a sample index), per epoch and process.

>>> order = mixture_order([6, 3], [2 / 3, 1 / 3], seed=0, epoch=0, shuffle=False)
>>> order.components.tolist()
[0, 1, 0, 0, 1, 0, 0, 1, 0]
>>> order.indices.tolist()
[0, 0, 1, 2, 1, 3, 4, 2, 5]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from shardcache.errors import ConfigError

__all__ = [
    "ON_EXHAUSTED",
    "MixOrder",
    "check_mixture",
    "mixture_order",
    "normalise_weights",
    "window_tolerance",
]

# What a component that runs out of samples does: start a new pass over a
# new permutation, or end the epoch before its first repeat.
ON_EXHAUSTED = ("cycle", "end_epoch")
_MIX_SALT = 0x313  # separates a mixture's permutations from a component's own
_MASK = 2**64 - 1  # a negative seed still seeds (numpy takes only entries >= 0)


@dataclass(frozen=True)
class MixOrder:
    """One epoch of a mixture: position ``p`` reads sample ``indices[p]`` of
    component ``components[p]``."""

    components: np.ndarray
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.components)


def _names(names: Sequence[str] | None, k: int) -> list[str]:
    return list(names) if names is not None else [f"component {i}" for i in range(k)]


def normalise_weights(
    weights: Sequence[float], names: Sequence[str] | None = None
) -> np.ndarray:
    """Weights as fractions summing to 1.

    Raises:
        ConfigError: a weight is negative, NaN or infinite, or all are zero.

    >>> normalise_weights([7, 2, 1]).tolist()
    [0.7, 0.2, 0.1]
    """
    try:
        w = np.asarray([float(x) for x in weights], dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"weights must be numbers, one per component, got {weights!r}."
        ) from exc
    labels = _names(names, len(w))
    bad = [
        f"{labels[i]}={float(w[i])!r}"
        for i in range(len(w))
        if not (math.isfinite(w[i]) and w[i] >= 0)
    ]
    if bad:
        raise ConfigError(
            f"weights must be finite and >= 0, got {', '.join(bad)}; a component "
            "you do not want this epoch takes weight 0."
        )
    if not len(w) or w.sum() <= 0:
        raise ConfigError(
            f"weights are all zero ({weights!r}); give at least one component a "
            "weight above 0."
        )
    total = float(w.sum())
    # Weights that already sum to 1 (up to rounding: 0.7 + 0.2 + 0.1 is
    # 0.9999999999999999) are kept as written, as the state records them.
    return w if math.isclose(total, 1.0, rel_tol=1e-12) else w / total


def window_tolerance(weights: Sequence[float] | np.ndarray) -> np.ndarray:
    """Per component, the most its count in any window of ``m`` consecutive
    positions differs from ``w_k * m``: ``1 + (K - 2) * w_k``.

    Why: at a due time ``t`` component ``k`` has ``w_k t + e_k`` draws with
    ``|e_k| <= 1/2``, so a prefix of ``sum_j (w_j t + e_j)`` positions holds
    ``w_k`` times that plus ``(1 - w_k) e_k - w_k sum_{j != k} e_j``, at
    most ``1/2 + (K - 2) w_k / 2`` away; a window is two prefixes apart.

    >>> window_tolerance([0.5, 0.5]).tolist()
    [1.0, 1.0]
    """
    w = np.asarray(weights, dtype=np.float64)
    k = int(np.count_nonzero(w > 0))
    return 1.0 + max(k - 2, 0) * w


def _due_draws(weights: np.ndarray, horizon: float) -> tuple[np.ndarray, np.ndarray]:
    """Every draw due up to ``horizon`` and a little beyond, sorted by due
    time (ties by component): (component, draw number) per position."""
    comps, draws, times = [], [], []
    for k in np.flatnonzero(weights > 0).tolist():
        # floor(w t + 1/2) draws are due by t; two more cover the float edge.
        count = int(math.floor(weights[k] * horizon + 0.5)) + 2
        j = np.arange(count, dtype=np.int64)
        comps.append(np.full(count, k, dtype=np.int16))
        draws.append(j)
        times.append((j + 0.5) / weights[k])
    comp, draw, due = (
        np.concatenate(comps),
        np.concatenate(draws),
        np.concatenate(times),
    )
    by_due = np.lexsort((comp, due))
    return comp[by_due], draw[by_due]


def _epoch_length(
    comp: np.ndarray,
    draw: np.ndarray,
    sizes: np.ndarray,
    on_exhausted: str,
    epoch_samples: int | None,
) -> int:
    # The first draw past a component's end, and the last draw that reads a
    # component's final sample: where "end_epoch" and "cycle" stop.
    past_end = draw >= sizes[comp]
    if on_exhausted == "end_epoch":
        length = int(np.argmax(past_end)) if past_end.any() else len(comp)
        return length if epoch_samples is None else min(length, epoch_samples)
    if epoch_samples is not None:
        return epoch_samples
    # The horizon is the latest of these due times, so each one is present.
    return int(np.flatnonzero(draw == sizes[comp] - 1).max()) + 1


def check_mixture(
    sizes: Sequence[int] | np.ndarray,
    weights: Sequence[float] | np.ndarray,
    on_exhausted: str = "cycle",
    epoch_samples: int | None = None,
    names: Sequence[str] | None = None,
) -> np.ndarray:
    """Validate a mixture's settings; returns the normalised weights.

    Raises:
        ConfigError: bad weights, one weight per component missing, a
            component with no samples (named), an unknown ``on_exhausted``
            or an ``epoch_samples`` below 1.

    >>> check_mixture([4, 0], [1, 1], names=["web", "code"])
    Traceback (most recent call last):
    ...
    shardcache.errors.ConfigError: component 'code' has no samples; check its source or leave it out of the mixture.
    """
    labels = _names(names, len(sizes))
    sizes = np.asarray(sizes, dtype=np.int64)
    if len(list(weights)) != len(sizes):
        raise ConfigError(
            f"weights has {len(list(weights))} entries but there are {len(sizes)} "
            "components; give one weight per component."
        )
    w = normalise_weights(weights, labels)
    empty = [labels[i] for i in np.flatnonzero(sizes <= 0).tolist()]
    if empty:
        raise ConfigError(
            f"component {', '.join(map(repr, empty))} has no samples; check its "
            "source or leave it out of the mixture."
        )
    if on_exhausted not in ON_EXHAUSTED:
        raise ConfigError(
            f"on_exhausted must be one of {ON_EXHAUSTED}, got {on_exhausted!r}."
        )
    if epoch_samples is not None and (
        not isinstance(epoch_samples, int) or epoch_samples < 1
    ):
        raise ConfigError(
            f"epoch_samples must be an integer >= 1 or None, got {epoch_samples!r}."
        )
    return w


def mixture_order(
    sizes: Sequence[int] | np.ndarray,
    weights: Sequence[float] | np.ndarray,
    seed: int,
    epoch: int,
    *,
    shuffle: bool = True,
    on_exhausted: str = "cycle",
    epoch_samples: int | None = None,
    names: Sequence[str] | None = None,
) -> MixOrder:
    """The mixture's global sequence for ``epoch``.

    Args:
        sizes: samples per component.
        weights: per component (normalised here; 0 leaves a component out).
        seed, epoch: the permutations' seed.
        shuffle: walk each component in a seeded permutation per pass, else
            in index order. Defaults to ``True``.
        on_exhausted: ``"cycle"``: the epoch lasts until every component
            with a weight has read each of its samples once, the others
            starting new passes meanwhile; ``"end_epoch"``: it ends before
            the first repeated sample. Defaults to ``"cycle"``.
        epoch_samples: a fixed epoch length instead (``"end_epoch"``: at
            most this). Defaults to ``None``.
        names: for error messages.

    Raises:
        ConfigError: bad weights, a component with no samples, an unknown
            ``on_exhausted`` or an ``epoch_samples`` below 1.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    w = check_mixture(sizes, weights, on_exhausted, epoch_samples, names)
    live = w > 0
    if epoch_samples is not None and on_exhausted == "cycle":
        horizon = epoch_samples + int(live.sum())  # >= epoch_samples draws due
    elif on_exhausted == "end_epoch":
        horizon = float(np.min((sizes[live] + 0.5) / w[live]))
    else:
        horizon = float(np.max((sizes[live] - 0.5) / w[live]))
    comp, draw = _due_draws(w, horizon)
    length = _epoch_length(comp, draw, sizes, on_exhausted, epoch_samples)
    comp, draw = comp[:length], draw[:length]
    index = np.empty(length, dtype=np.int64)
    for k in np.unique(comp).tolist():
        mine = np.flatnonzero(comp == k)
        n = int(sizes[k])
        passes, rows = np.divmod(draw[mine], n)
        if not shuffle:
            index[mine] = rows
            continue
        # One permutation per pass: a Python loop per pass, never per sample.
        for p in np.unique(passes).tolist():
            perm = np.random.default_rng(
                [seed & _MASK, epoch, _MIX_SALT, k, p]
            ).permutation(n)
            sel = passes == p
            index[mine[sel]] = perm[rows[sel]]
    return MixOrder(comp, index)
