"""``shardcache verify``: the index and the stores agree, and every chunk's
contents match the checksum written when it was built (``checksum.py``)."""

from __future__ import annotations

from typing import Any

from shardcache.index import RedisIndex

__all__ = ["check_agreement", "check_contents"]


def check_agreement(
    index: RedisIndex, handles: dict[str, Any], dataset: str
) -> list[str]:
    """Return every disagreement between the index and the stores (empty: they agree).

    Checked: each index entry of the current generation is held by the store
    it names, with the same ETag; each value a store holds is of the current
    generation (no orphans left by an invalidation) and is in the index.
    """
    import ray

    generation = index.generation(dataset)
    entries = index.entries(dataset, generation)
    held = dict(
        zip(
            handles,
            ray.get([h.snapshot.remote(dataset) for h in handles.values()]),
            strict=True,
        )
    )
    problems = []
    for url, entry in entries.items():
        node = str(entry.get("owner"))
        value = held.get(node, {}).get(url)
        if value is None:
            problems.append(
                f"index entry {url} names node {node[:8]}, which does not hold it"
            )
        elif value["etag"] != entry.get("etag"):
            problems.append(
                f"{url}: index ETag {entry.get('etag')} != held {value['etag']}"
            )
    for node, values in held.items():
        for url, value in values.items():
            if value["generation"] != generation:
                problems.append(
                    f"node {node[:8]} holds {url} of old generation {value['generation']}"
                )
            elif url not in entries or str(entries[url].get("owner")) != node:
                problems.append(
                    f"node {node[:8]} holds {url}, which the index does not point at"
                )
    return problems


def check_contents(
    handles: dict[str, Any], dataset: str, repair: bool = False
) -> tuple[list[str], int, list[str]]:
    """Check the contents of every chunk of ``dataset`` on every store.

    Returns ``(problems, chunks checked, repaired)``: one problem per chunk
    whose bytes fail its checksum (named with its node), and, with
    ``repair``, the chunks dropped and rebuilt that verify now. A chunk
    rebuilt but still failing stays a problem.
    """
    import ray

    reports = ray.get(
        [h.verify_contents.remote(dataset, repair) for h in handles.values()]
    )
    problems: list[str] = []
    repaired: list[str] = []
    checked = 0
    for node, report in zip(handles, reports, strict=True):
        checked += report["checked"]
        fixed = set(report["repaired"])
        for chunk in report["bad"]:
            where = f"node {node[:8]} chunk {chunk}"
            if chunk in fixed:
                repaired.append(where)
            elif repair and chunk.endswith("(disk)"):
                repaired.append(f"{where}: deleted; the next read rebuilds it")
            else:
                problems.append(f"{where}: contents fail their checksum")
    return problems, checked, repaired
