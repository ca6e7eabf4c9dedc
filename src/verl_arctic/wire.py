"""Arctic's two body encodings, with nothing unpickled that is not plain data.

- ``torch`` (protocol generation v0.1): ``torch.save`` of plain containers of
  tensors and JSON scalars. Decoding uses ``torch.load(weights_only=True)``,
  which refuses arbitrary pickled objects, with its allowlist extended by
  exactly one container Arctic's server code produces: the
  ``collections.defaultdict(list)`` of ``merge_dict_shards``
  (``rl/utils/batch.py:198-219`` in arctic-platform 0.1.2), which the
  forward route answers with when the job has several data-parallel ranks
  (``rl/http_server.py:429-437``). It decodes to a plain dict, so a missing
  key is a KeyError, not a silently created empty list. Anything else that is
  not plain data is refused with the offending global named.
- ``dssst1`` (generation main): one safetensors frame whose ``__metadata__``
  holds the structure (``{"v": "DSSST1", "tree": node}``) and whose tensors are
  named by their dotted path. No pickle at all. See docs/arctic-protocol.md §4.2.
"""

from __future__ import annotations

import io
import json
import re
import threading
from typing import Any

import torch

__all__ = ["WireError", "decode", "decode_dssst1", "decode_torch", "encode", "encode_dssst1", "encode_torch"]

DSS_VERSION = "DSSST1"
EMPTY_KEY = "__dss_empty__"
ROOT_KEY = "__root__"
MAX_HEADER = 64 * 1024 * 1024
_PICKLE_OR_ZIP = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05", b"PK\x03\x04")


class WireError(ValueError):
    """A body that is not a valid payload of the expected encoding."""


# -- v0.1: torch.save ---------------------------------------------------------------------


def encode_torch(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# Arctic's server pickles one container beyond torch's weights-only defaults: merge_dict_shards's
# ``defaultdict(list)``, whose pickle names ``collections.defaultdict`` and its ``list`` default
# factory. torch cannot rebuild a defaultdict even when it is allowlisted (its unpickler sets items
# on plain dicts only), so those two names are allowlisted as stand-ins instead: the factory as an
# inert marker, the class as a function that accepts only that marker and returns an empty plain
# dict for the pickle to fill. Nothing else is added; no other name resolves.
_LIST_FACTORY = object()


def _merged_dict(default_factory: object) -> dict[Any, Any]:
    # The process may have allowlisted the real ``list`` itself; torch then resolves the name to it.
    if default_factory is not _LIST_FACTORY and default_factory is not list:
        raise WireError("refusing a collections.defaultdict whose default factory is not list")
    return {}


ARCTIC_CONTAINERS: list[tuple[Any, str]] = [
    (_merged_dict, "collections.defaultdict"),
    (_LIST_FACTORY, "builtins.list"),
]
# torch's allowlist is one process-wide set that its context manager adds to and removes from.
_ALLOWLIST_LOCK = threading.Lock()


def decode_torch(data: bytes) -> Any:
    try:
        with _ALLOWLIST_LOCK, torch.serialization.safe_globals(ARCTIC_CONTAINERS):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except WireError:
        raise
    except Exception as exc:
        lines = str(exc).splitlines()
        unsupported = re.search(r"GLOBAL ([\w.]+)", str(exc))
        if unsupported is not None:
            name = unsupported.group(1)
            raise WireError(
                f"refusing to unpickle {name}: an Arctic v0.1 payload holds only tensors, plain containers "
                "(dict, list, tuple, collections.defaultdict(list)) and scalars"
            ) from exc
        detail = re.search(r"WeightsUnpickler error:(.*?)(?:Check the documentation|$)", str(exc), re.DOTALL)
        reason = " ".join(detail.group(1).split()) if detail else (lines[0] if lines else "")
        raise WireError(f"not a plain-data torch.save payload: {type(exc).__name__}: {reason}") from exc


# -- main: DSSST1 -------------------------------------------------------------------------


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, dict):
        return any(_has_tensor(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(_has_tensor(v) for v in obj)
    return False


def _encode_node(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> list[Any]:
    if isinstance(obj, torch.Tensor):
        key = path or ROOT_KEY
        tensor = obj.detach().to("cpu").contiguous().clone()
        if tensor.dim() == 0:
            tensors[key] = tensor.reshape(1)
            return ["t", key, {"scalar": True}]
        tensors[key] = tensor
        return ["t", key]
    if isinstance(obj, tuple):
        return ["u", [_encode_node(v, f"{path}.{i}" if path else str(i), tensors) for i, v in enumerate(obj)]]
    if not _has_tensor(obj):
        return ["j", obj]
    if isinstance(obj, dict):
        items = []
        for key, value in obj.items():
            if not isinstance(key, str):
                raise WireError(f"DSSST1 dict keys must be strings, got {type(key).__name__}")
            items.append([key, _encode_node(value, f"{path}.{key}" if path else key, tensors)])
        return ["d", items]
    if isinstance(obj, list):
        return ["l", [_encode_node(v, f"{path}.{i}" if path else str(i), tensors) for i, v in enumerate(obj)]]
    raise WireError(f"DSSST1 cannot encode {type(obj).__name__}")


def encode_dssst1(obj: Any) -> bytes:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    tree = _encode_node(obj, "", tensors)
    if not tensors:
        tensors[EMPTY_KEY] = torch.zeros(1, dtype=torch.uint8)
    metadata = {"dss": json.dumps({"v": DSS_VERSION, "tree": tree})}
    return bytes(save(tensors, metadata=metadata))


def _decode_node(node: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if not isinstance(node, list) or not node:
        raise WireError(f"malformed DSSST1 node {node!r}")
    tag = node[0]
    if tag == "t":
        tensor = tensors[node[1]]
        if len(node) > 2 and node[2].get("scalar"):
            return tensor.reshape(())
        return tensor
    if tag == "j":
        return node[1]
    if tag == "d":
        return {key: _decode_node(child, tensors) for key, child in node[1]}
    if tag == "l":
        return [_decode_node(child, tensors) for child in node[1]]
    if tag == "u":
        return tuple(_decode_node(child, tensors) for child in node[1])
    raise WireError(f"unknown DSSST1 node tag {tag!r}")


def _frame(data: bytes) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The safetensors header and tensors of ``data``; ValueError when it is not a safetensors frame."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if len(data) < 8 or not 0 < int.from_bytes(data[:8], "little") <= min(MAX_HEADER, len(data) - 8):
        raise ValueError("bad header length")
    header_len = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + header_len])
        tensors = load(data)
    except SafetensorError as exc:
        raise ValueError(str(exc)) from exc
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, tensors


def decode_dssst1(data: bytes) -> Any:
    # A frame is tried first, as Arctic's wire.loads does: a valid frame's 8-byte header length can itself
    # start with a pickle signature (a header of 640 bytes is b"\x80\x02...").
    try:
        header, tensors = _frame(data)
    except ValueError as exc:
        if data.startswith(_PICKLE_OR_ZIP):
            raise WireError(
                "refusing to deserialize a legacy pickle/torch.save payload; "
                "the peer must use the DSSST1 safetensors wire protocol"
            ) from exc
        raise WireError(f"not a valid DSSST1 safetensors payload: {exc}") from exc
    dss = (header.get("__metadata__") or {}).get("dss")
    if dss is None:
        raise WireError("DSSST1 structure missing from safetensors header")
    structure = json.loads(dss)
    if structure.get("v") != DSS_VERSION:
        raise WireError(f"unsupported DSSST1 wire version {structure.get('v')!r}")
    tensors.pop(EMPTY_KEY, None)
    return _decode_node(structure["tree"], tensors)


# -- by name ------------------------------------------------------------------------------

_CODECS = {"torch": (encode_torch, decode_torch), "dssst1": (encode_dssst1, decode_dssst1)}


def encode(encoding: str, obj: Any) -> bytes:
    return _CODECS[encoding][0](obj)


def decode(encoding: str, data: bytes) -> Any:
    return _CODECS[encoding][1](data)
