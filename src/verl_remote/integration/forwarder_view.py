"""What a forwarder fetches of a step's batch: its tensors, not the prompts' text and records.

verl's V1 trainer hands its worker group a TransferQueue batch (a ``KVBatchMeta``) naming every field the step's
trajectories hold, and verl's ``tqbridge`` fetches all of them in the worker before the call: the dataset's columns
(the prompt's messages, the reward model's answer, ``extra_info``), the agent loop's records (its timings, its
extra fields) and the tensors. A forwarder computes with the tensors alone (:mod:`verl_remote.integration.worker`
passes a backend the batch's tensors), and TransferQueue rebuilds each non-tensor value as an object of its own,
about a third of a forwarder's CPU at 512 samples a step (docs/measurements.md, "The client's cost").
:class:`TensorFieldsOnly` is the trainer's worker group for those calls, with each batch narrowed to its tensor
fields (TransferQueue's own schema says which are).
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TensorFieldsOnly", "tensor_fields"]

#: The worker group's calls that fetch a batch.
NARROWED = ("compute_log_prob", "compute_ref_log_prob", "update_actor")


def tensor_fields(meta: Any, known: dict[str, bool]) -> list[str]:
    """The fields of ``meta`` (a ``KVBatchMeta``) that hold tensors, in its order; ``known`` caches each field's
    answer (TransferQueue's field schema, read once a field is new)."""
    fields = list(meta.fields or [])
    if any(name not in known for name in fields):
        from verl.utils.transferqueue_utils import kv_batch_meta2batch_meta

        schema = kv_batch_meta2batch_meta(dataclasses.replace(meta, extra_info={})).field_schema
        for name in fields:
            known[name] = not schema.get(name, {}).get("is_non_tensor", False)
    return [name for name in fields if known[name]]


class TensorFieldsOnly:
    """A worker group whose batch-fetching calls (:data:`NARROWED`) get the batch's tensor fields only; everything
    else is the group's own."""

    def __init__(self, group: Any) -> None:
        self._group = group
        self._known: dict[str, bool] = {}

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._group, name)
        if name not in NARROWED:
            return value

        def call(batch: Any, *args: Any, **kwargs: Any) -> Any:
            if getattr(batch, "fields", None):  # a KVBatchMeta naming its fields: the same batch, fewer fields
                narrowed = dataclasses.replace(batch, fields=tensor_fields(batch, self._known))
                narrowed.extra_info = batch.extra_info  # what verl sets on it for the call, as it set it
                batch = narrowed
            return value(batch, *args, **kwargs)

        return call
