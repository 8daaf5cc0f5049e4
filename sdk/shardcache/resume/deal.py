"""Placing pieces of an epoch on ranks: home node first, bounded load, rendezvous hashing.

A piece is the remaining samples of one chunk that one node read. Each node's
pieces go to that node's ranks while they have room; only the overflow moves,
to the best-scoring rank, so the moved fraction is the least the new shape
allows. Cost: Python loops per piece (per chunk), never per sample.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["Deal", "give_extra", "group_pieces", "mix64"]


def mix64(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = values.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def give_extra(
    cap: np.ndarray, extra: int, nodes: list[Any], held: dict[str, int]
) -> None:
    """Give the ``extra`` one-sample-more slots to ranks of the nodes that hold
    more than their ranks can take, so they need not move (then to the first
    ranks)."""
    over = {n: held.get(n, 0) for n in dict.fromkeys(nodes)}
    for r, n in enumerate(nodes):
        over[n] -= int(cap[r])
    given = np.zeros(len(cap), dtype=bool)
    for _ in range(extra):
        best = max(
            (r for r in range(len(cap)) if not given[r]),
            key=lambda r: (over[nodes[r]] > 0, over[nodes[r]], -r),
        )
        given[best] = True
        cap[best] += 1
        over[nodes[best]] -= 1


def group_pieces(
    sizes: np.ndarray, left: np.ndarray, holder: np.ndarray, old_nodes: list[str]
) -> tuple[list[np.ndarray], list[str]]:
    """The remaining samples grouped by (chunk, node that read it), in chunk order."""
    starts = np.concatenate(([0], np.cumsum(sizes)))
    chunk = np.searchsorted(starts, left, side="right") - 1
    node_ids = {n: i for i, n in enumerate(dict.fromkeys(old_nodes))}
    node_of_rank = np.array([node_ids[n] for n in old_nodes], dtype=np.int64)
    key = chunk * len(node_ids) + node_of_rank[holder]
    order = np.argsort(key, kind="stable")
    key, left = key[order], left[order]
    cuts = np.flatnonzero(np.diff(key)) + 1
    names = list(node_ids)
    homes = [names[int(k) % len(node_ids)] for k in key[np.concatenate(([0], cuts))]]
    return (np.split(left, cuts) if len(left) else []), (homes if len(left) else [])


class Deal:
    """Bounded-load rendezvous placement of pieces on ranks, home node first."""

    def __init__(self, cap: np.ndarray, nodes: list[Any], seed: int):
        self.cap, self.nodes, self.seed = cap, nodes, seed
        self.load = np.zeros(len(cap), dtype=np.int64)
        self.taken: list[list[np.ndarray]] = [[] for _ in cap]
        self.rank_salt = mix64(np.arange(1, len(cap) + 1))
        self.seed_salt = mix64(np.array([seed & 0xFFFFFFFF]))[0]
        self.dropped = 0

    def _prefs(self, piece: np.ndarray, among: list[int]) -> list[int]:
        # Keyed by the piece's first sample: the same piece prefers the same
        # ranks whichever node it comes from.
        h = mix64(np.array([int(piece[0]) + 1]))[0] ^ self.seed_salt
        scores = mix64(np.bitwise_xor(self.rank_salt[among], h))
        return [among[i] for i in np.argsort(-scores.astype(np.float64), kind="stable")]

    def _whole(self, pieces: list[np.ndarray], among: list[int]) -> list[np.ndarray]:
        rest = []
        for p in pieces:
            for r in self._prefs(p, among):
                if self.load[r] + len(p) <= self.cap[r]:
                    self.taken[r].append(p)
                    self.load[r] += len(p)
                    break
            else:
                rest.append(p)
        return rest

    def _split(self, pieces: list[np.ndarray], among: list[int]) -> list[np.ndarray]:
        rest = []
        for p in pieces:
            for r in self._prefs(p, among):
                take = int(min(len(p), self.cap[r] - self.load[r]))
                if take > 0:
                    self.taken[r].append(p[:take])
                    self.load[r] += take
                    p = p[take:]
                if len(p) == 0:
                    break
            if len(p):
                rest.append(p)
        return rest

    def place(self, pieces: list[np.ndarray], homes: list[str]) -> int:
        """Place every piece; returns the samples placed off their home node."""
        by_home: dict[str, list[np.ndarray]] = {}
        for p, h in zip(pieces, homes, strict=True):
            by_home.setdefault(h, []).append(p)
        pool: list[tuple[np.ndarray, str]] = []
        # Per node: whole chunks to its ranks first, then split the rest
        # between them; only what exceeds the node's capacity leaves it.
        for home, group in by_home.items():
            local = [r for r, n in enumerate(self.nodes) if n == home]
            rest = self._split(self._whole(group, local), local) if local else group
            pool += [(p, home) for p in rest]
        everyone = list(range(len(self.cap)))
        before = self.load.copy()
        rest = self._split(self._whole([p for p, _ in pool], everyone), everyone)
        self.dropped = int(sum(len(p) for p in rest))
        return int((self.load - before).sum())
