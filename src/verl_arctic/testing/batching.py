"""How an Arctic server splits a batch across its ranks and micro-batches, and merges the answers.

The test server's model of what Arctic's server does around its engines, in
our own words, with the behaviour traced to Arctic's code (arctic-platform
0.1.2 ``rl/utils/batch.py`` for generation v0.1; 0.1.4
``common/utils/batch.py`` for main). The containers matter: a client decodes
exactly what these functions build.

- :func:`split_rows`: every tensor of a batch cut along dim 0 into ``n`` parts
  (the data-parallel split, and each rank's gradient-accumulation micro-batches).
  v0.1 cuts with ``torch.chunk``, which can give fewer than ``n`` parts, and
  then indexes the missing ones (an IndexError: a bare 500); main cuts with
  ``torch.tensor_split``. Fewer rows than parts is a ValueError in both.
- :func:`merge_shards`: answers of several ranks (or micro-batches) merged into a
  ``collections.defaultdict(list)``: tensors concatenated, lists extended, other
  values collected into a list. A single answer is returned as it is.
- :func:`combine_microbatch_metrics` and :func:`combine_rank_metrics`: a loss's
  paired ``X.sum``/``X.tokens`` metrics summed over micro-batches, then folded
  into ``X = sum/tokens`` across ranks; other numbers averaged (main sums the
  names its registry calls additive: ``loss_term_*``, ``*_sum``, ``*_count``).
"""

from __future__ import annotations

import collections
from typing import Any

import torch

__all__ = ["combine_microbatch_metrics", "combine_rank_metrics", "merge_shards", "split_rows"]

SUM, TOKENS = ".sum", ".tokens"


def _split_value(value: Any, parts: int, generation: str) -> list[Any]:
    if isinstance(value, torch.Tensor):
        if value.shape[0] < parts:  # v0.1 batch.py:74-83, main batch.py:148-157
            raise ValueError(
                f"Batch dimension {value.shape[0]} is smaller than num_workers {parts}. "
                "The client must send at least one sample per DP worker."
            )
        if generation == "v0.1":
            return list(torch.chunk(value, parts, dim=0))
        return list(torch.tensor_split(value, parts, dim=0))
    if isinstance(value, list):
        if len(value) < parts:
            raise ValueError(
                f"Batch size {len(value)} is smaller than num_workers {parts}. "
                "The client must send at least one sample per DP worker."
            )
        size = (len(value) + parts - 1) // parts
        return [value[i * size : (i + 1) * size] for i in range(parts)]
    return [value] * parts


def split_rows(batch: dict[str, Any], parts: int, generation: str) -> list[dict[str, Any]]:
    """``batch`` cut into ``parts`` row ranges (v0.1 batch.py:96-101, main batch.py:170-175)."""
    if not batch:
        return [{} for _ in range(parts)]
    cut = {key: _split_value(value, parts, generation) for key, value in batch.items()}
    # torch.chunk may return fewer parts than asked; Arctic indexes all of them regardless.
    return [{key: cut[key][i] for key in batch} for i in range(parts)]


def merge_shards(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Several answers as one (v0.1 batch.py:198-219, main batch.py:316-343)."""
    if len(shards) <= 1:
        return shards[0] if shards else {}
    merged: collections.defaultdict[str, Any] = collections.defaultdict(list)
    for shard in shards:
        for key, value in shard.items():
            if isinstance(value, list):
                merged[key].extend(value)
            else:
                merged[key].append(value)
    for key, value in merged.items():
        if isinstance(value, list) and all(torch.is_tensor(item) for item in value):
            merged[key] = torch.cat(value)
    return merged


def _numbers(dicts: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, int], dict[str, Any]]:
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    passthrough: dict[str, Any] = {}
    for metrics in dicts:
        for key, value in (metrics or {}).items():
            if isinstance(value, bool) or not isinstance(value, int | float):
                passthrough.setdefault(key, value)
                continue
            totals[key] = totals.get(key, 0.0) + float(value)
            counts[key] = counts.get(key, 0) + 1
    return totals, counts, passthrough


def _paired(totals: dict[str, float]) -> set[str]:
    return {key[: -len(SUM)] for key in totals if key.endswith(SUM) and key[: -len(SUM)] + TOKENS in totals}


def combine_microbatch_metrics(per_micro_batch: list[dict[str, Any]], generation: str) -> dict[str, Any]:
    """One rank's metrics of one call (v0.1 batch.py:312-373, main batch.py:466-528)."""
    totals, counts, passthrough = _numbers(per_micro_batch)
    paired = _paired(totals)
    keep = {base + suffix for base in paired for suffix in (SUM, TOKENS)}
    out: dict[str, Any] = {
        key: total if key in keep or (generation == "main" and _summed(key)) else total / counts[key]
        for key, total in totals.items()
    }
    for key, value in passthrough.items():
        out.setdefault(key, value)
    return out


def _summed(key: str) -> bool:
    # main batch.py:346-361: no loss of ours declares summed metrics, so the naming convention decides.
    return key.startswith("loss_term_") or key.endswith(("_sum", "_count"))


def combine_rank_metrics(per_rank: list[dict[str, Any]], generation: str) -> dict[str, Any]:
    """All ranks' metrics of one call (v0.1 batch.py:226-309, main batch.py:364-450)."""
    totals, counts, passthrough = _numbers(per_rank)
    paired = _paired(totals)
    out: dict[str, Any] = {}
    for base in paired:
        tokens = totals[base + TOKENS]
        out[base] = totals[base + SUM] / tokens if tokens > 0 else 0.0
    for key, total in totals.items():
        for suffix in (SUM, TOKENS):
            if key.endswith(suffix) and key[: -len(suffix)] in paired:
                break
        else:
            if key not in out:
                out[key] = total if generation == "main" and _summed(key) else total / counts[key]
    for key, value in passthrough.items():
        out.setdefault(key, value)
    return out
