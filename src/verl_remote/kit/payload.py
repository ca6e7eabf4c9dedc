"""verl's jagged batches as plain numpy arrays, for shipping to a backend.

verl's V1 trainer hands workers TensorDicts of jagged (nested) tensors: one row
per sample, no padding. A :class:`Packed` field keeps exactly that layout, the
flat values and the row offsets, as numpy arrays. Ray serialises numpy arrays
out of band into its shared-memory object store and reads them back without a
copy, while a torch tensor passed as an actor argument is pickled (about 6x
slower here, see docs/measurements.md); HTTP backends can encode the same two
arrays directly.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["Packed", "pack", "pack_fields", "to_nested", "unpack_like"]


@dataclass(frozen=True)
class Packed:
    """One jagged field: ``values[offsets[i]:offsets[i+1]]`` is row ``i``."""

    values: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self) -> list[np.ndarray]:
        return [self.values[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:], strict=True)]


def pack(tensor: Any) -> Packed:
    """A jagged torch tensor (or a dense [B, L] one, every row full) as :class:`Packed`."""
    import torch

    if tensor.is_nested:
        values, offsets = tensor.values(), tensor.offsets()
    else:
        rows, width = tensor.shape[0], tensor.shape[1]
        values = tensor.reshape(rows * width, *tensor.shape[2:])
        offsets = torch.arange(0, rows * width + 1, width)
    return Packed(values.detach().cpu().numpy(), offsets.detach().cpu().numpy().astype(np.int64))


def pack_fields(data: Any, keys: Iterable[str]) -> dict[str, Packed]:
    """The given keys of a TensorDict, packed; keys absent from ``data`` are skipped."""
    present = set(data.keys())
    return {key: pack(data[key]) for key in keys if key in present}


def to_nested(packed: Packed) -> Any:
    """Back to a jagged torch tensor (shares memory with the numpy arrays where it can)."""
    import torch

    with warnings.catch_warnings():
        # Arrays read from Ray's object store are read-only; the tensors built on
        # them are only read, so sharing the memory is safe.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        values = torch.from_numpy(np.ascontiguousarray(packed.values))
        offsets = torch.from_numpy(np.ascontiguousarray(packed.offsets))
    lengths = packed.lengths
    # Without explicit bounds torch derives the padded width from the values, not the rows.
    return torch.nested.nested_tensor_from_jagged(
        values, offsets, min_seqlen=int(lengths.min(initial=0)), max_seqlen=int(lengths.max(initial=0))
    )


def unpack_like(values: np.ndarray, like: Packed) -> Any:
    """Flat ``values`` laid out as the rows of ``like``, as a jagged torch tensor."""
    if len(values) != like.offsets[-1]:
        raise ValueError(f"{len(values)} values do not fit rows with {int(like.offsets[-1])} elements")
    return to_nested(Packed(values, like.offsets))
