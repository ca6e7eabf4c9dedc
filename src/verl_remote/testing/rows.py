"""Per-token values over whole rows, cut the way the checks read them (verl_remote.kit.compute's layout)."""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["responses_of", "split"]


def responses_of(values: np.ndarray, rows: list[list[int]], responses: list[list[int]]) -> list[np.ndarray]:
    """Each row's response part of per-token values over whole rows (response token j at n - r - 1 + j)."""
    from verl_remote.kit.compute import response_index

    picked = values[response_index([len(r) for r in rows], [len(r) for r in responses]).numpy()]
    return split(picked, [len(r) for r in responses])


def split(values: np.ndarray, lengths: list[int]) -> list[np.ndarray]:
    """``values`` cut into consecutive pieces of ``lengths``."""
    edges = np.cumsum([0, *lengths])
    return [values[a:b] for a, b in itertools.pairwise(edges)]
