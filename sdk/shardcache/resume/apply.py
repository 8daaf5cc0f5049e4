"""Pointing a sampler at the rest of a saved epoch: check the state, then resume or re-deal.

A state saved on another listing of the source (objects rewritten since) is
resumed as ``on_change`` says:

* ``"error"`` (the default): refused, naming the changed objects. The only
  choice that keeps a resumed run's data exactly what an uninterrupted run
  would have read.
* ``"new_listing"``: the saved epoch and consumed counts apply to today's
  listing. Positions are a pure function of the sample layout (chunk sizes),
  which a re-listing keeps while the same objects are listed, so every
  sample not yet delivered is delivered once and none twice. Given up: a
  changed object delivered before the save was trained on at its old
  version, and one not yet delivered is read at its new version, so that
  epoch mixes the two listings. Objects added or removed move the
  positions: that is refused too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from shardcache.errors import ConfigError
from shardcache.resume.state import (
    check_state,
    current_node,
    gather_nodes,
    merge_states,
)

__all__ = ["ON_CHANGE", "apply_state", "check_on_change", "crossed_listing"]

log = logging.getLogger("shardcache")

# What a resume does when the source changed since the state was saved.
ON_CHANGE = ("error", "new_listing")


def check_on_change(on_change: str) -> str:
    """``on_change``, validated.

    Raises:
        ConfigError: not one of ``ON_CHANGE``.

    >>> check_on_change("new_listing")
    'new_listing'
    """
    if on_change not in ON_CHANGE:
        raise ConfigError(
            f"on_change must be one of {', '.join(map(repr, ON_CHANGE))}, got "
            f"{on_change!r}."
        )
    return on_change


def apply_state(
    sampler: Any,
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    digest: str,
    nodes: Sequence[str] | None = None,
    explain: Callable[[str], str] | None = None,
    *,
    on_change: str = "error",
    layout: str | None = None,
    dataset: str,
) -> int:
    """Point ``sampler`` (a ShardSampler) at the rest of the saved epoch; returns
    the samples this rank already consumed of its (new) order.

    ``state`` is one rank's state (same world and rank), a list of every
    rank's, or a merged one. A merged state of the same world on the same
    nodes (or unknown nodes) continues each rank's own order; otherwise the
    rest is re-dealt (:func:`plan_resume`) over ``nodes``, gathered over the
    process group when not given. ``explain(saved_digest)`` says what
    changed between the saved listing and this one (the error names it).
    ``on_change`` says what a state saved on another listing does (module
    docstring); ``layout`` is this listing's :func:`layout_digest`, which a
    ``"new_listing"`` resume needs to equal the saved one. ``dataset`` is
    this dataset's name, which a state saved by another must not carry.

    Raises:
        ConfigError: another seed, mode or listing (``on_change="error"``),
            or a listing whose samples moved (``"new_listing"``); one rank's
            state for another world; a world change with no way to know the
            nodes.
    """
    check_on_change(on_change)
    check_state(state, dataset)
    merged = None
    if not isinstance(state, Mapping) or isinstance(state.get("consumed"), list):
        merged = merge_states([state] if isinstance(state, Mapping) else state)
        state = merged
    mine = sampler.state()
    keys = ("seed", "mode") if merged else ("seed", "rank", "world_size", "mode")
    for key in keys:
        if state.get(key) != mine[key]:
            hint = (
                " To resume at another world size pass every rank's state."
                if key in ("rank", "world_size")
                else ""
            )
            raise ConfigError(
                f"state_dict has {key}={state.get(key)!r} but this dataset has "
                f"{mine[key]!r}; resume with the same settings.{hint}"
            )
    if int(state.get("block") or 0) != int(mine.get("block") or 0):
        raise ConfigError(
            f"state_dict has shuffle_block={state.get('block') or 0!r} but this "
            f"dataset has {mine.get('block') or 0!r}; resume with the same settings."
        )
    saved = state.get("manifest")
    if saved != digest and (
        on_change == "error" or layout is None or state.get("layout") != layout
    ):
        what = explain(str(saved)) if explain is not None else "the objects changed"
        if on_change == "error":
            raise ConfigError(
                f"state_dict was saved on another listing of the source ({what}). "
                "Restore those objects and resume, pass on_change='new_listing' "
                "to finish the epoch on today's listing (changed objects not yet "
                "delivered are read at their new version), or start the epoch "
                "over (skip load_state_dict)."
            )
        raise ConfigError(
            f"on_change='new_listing' cannot map the saved positions onto "
            f"today's listing ({what}): objects were added or removed (or the "
            "state predates layout records), so its samples moved. Start the "
            "epoch over (skip load_state_dict)."
        )
    epoch = int(state["epoch"])
    # The first epoch of a listing read while it was listed: its order (and
    # length) from the segments it was saved with, before either is used.
    sampler.use_segments(state.get("segments"))
    if merged is not None:
        world = sampler.world_size
        if nodes is None:
            nodes = gather_nodes(current_node(), world)
        if merged["world_size"] != world or (
            nodes is not None and list(nodes) != merged["nodes"]
        ):
            if nodes is None:
                raise ConfigError(
                    f"resuming {merged['world_size']} ranks' state at "
                    f"world_size={world} needs every new rank's node: "
                    "initialise torch.distributed or pass nodes=[...]."
                )
            sampler.resume_elastic(merged, nodes)
            sampler.resume(epoch, 0)
            return 0
        consumed = int(merged["consumed"][sampler.rank])
    else:
        consumed = int(state["consumed"])
    # (Inside an epoch that was itself resumed elastically the order is that
    # plan's; its own length is checked by the plan.)
    if state.get("resumed_from") is None and consumed > len(sampler):
        raise ConfigError(
            f"state_dict has consumed={consumed} but rank {sampler.rank}'s epoch "
            f"has {len(sampler)} samples; it was saved with other settings or "
            "changed. Pass the dict that state_dict() returned, unchanged."
        )
    sampler.use_basis(state.get("basis"))
    if state.get("resumed_from") is not None:
        # Saved inside an epoch that was itself resumed elastically.
        sampler.resume_elastic(state["resumed_from"], state["plan_nodes"])
    sampler.resume(epoch, consumed)
    return consumed


def crossed_listing(
    state: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    digest: str,
    explain: Callable[[str], str],
    name: str,
) -> dict[str, Any] | None:
    """What an applied ``state`` crossed: ``None`` when it was saved on
    ``digest`` (this listing), else the saved and current listings and what
    changed between them (``stats()["resumed_across_change"]``), logged once.
    Only an ``on_change="new_listing"`` resume gets this far across a change.
    """
    first = state if isinstance(state, Mapping) else (state[0] if state else {})
    saved = first.get("manifest")
    if saved is None or str(saved) == digest:
        return None
    what = explain(str(saved))
    log.warning(
        "shardcache: dataset %s resumed on a new listing (on_change="
        "'new_listing'; %s): changed objects not yet delivered this "
        "epoch are read at their new version",
        name,
        what,
    )
    return {"saved_listing": str(saved), "listing": digest, "changes": what}
