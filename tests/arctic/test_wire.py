"""Arctic's body encodings: round trips, the byte layout peers rely on, and refusals."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch
from safetensors import safe_open

from verl_arctic.wire import WireError, decode, decode_dssst1, decode_torch, encode, encode_dssst1, encode_torch

PAYLOAD = {
    "batch": {
        "input_ids": torch.arange(12, dtype=torch.int64).reshape(2, 6),
        "advantages": torch.randn(2, 6),
        "mask": torch.tensor([[True, False], [False, True]]),
    },
    "meta": {"temperature": 0.7, "rollout_n": 4, "batch_num_tokens": torch.tensor(9), "tags": ["a", "b"], "x": None},
    "processing": {"post": ["compute_entropy_and_logprobs"], "loss_fn": None},
    "pair": (1, torch.ones(3)),
}


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a == b


@pytest.mark.parametrize("encoding", ["torch", "dssst1"])
def test_round_trip_keeps_structure_dtypes_and_values(encoding: str) -> None:
    assert _equal(decode(encoding, encode(encoding, PAYLOAD)), PAYLOAD)


def test_dssst1_is_a_safetensors_frame_with_dotted_tensor_names_and_the_structure_in_metadata(tmp_path) -> None:
    path = tmp_path / "frame.safetensors"
    path.write_bytes(encode_dssst1(PAYLOAD))
    with safe_open(str(path), framework="pt") as frame:
        names = set(frame.keys())
        metadata = frame.metadata()
        scalar = frame.get_tensor("meta.batch_num_tokens")
    assert names == {"batch.input_ids", "batch.advantages", "batch.mask", "meta.batch_num_tokens", "pair.1"}
    assert scalar.shape == (1,)  # 0-d tensors travel as [1] and are reshaped back
    structure = json.loads(metadata["dss"])
    assert structure["v"] == "DSSST1"
    tag, items = structure["tree"]
    assert tag == "d" and [key for key, _ in items] == ["batch", "meta", "processing", "pair"]
    assert dict(items)["processing"] == ["j", {"post": ["compute_entropy_and_logprobs"], "loss_fn": None}]
    assert dict(items)["meta"][0] == "d" and dict(dict(items)["meta"][1])["batch_num_tokens"][2] == {"scalar": True}


def test_dssst1_without_tensors_carries_a_placeholder_that_decoding_drops(tmp_path) -> None:
    body = encode_dssst1({"prompts": ["say 7"], "sampling_params": {"temperature": 1.0}})
    path = tmp_path / "frame.safetensors"
    path.write_bytes(body)
    with safe_open(str(path), framework="pt") as frame:
        assert list(frame.keys()) == ["__dss_empty__"]
    assert decode_dssst1(body) == {"prompts": ["say 7"], "sampling_params": {"temperature": 1.0}}


def test_dssst1_refuses_pickles_torch_saves_and_garbage() -> None:
    for legacy in (pickle.dumps({"a": 1}), encode_torch({"a": torch.ones(1)})):
        with pytest.raises(WireError, match="refusing to deserialize a legacy pickle/torch.save payload"):
            decode_dssst1(legacy)
    with pytest.raises(WireError, match="not a valid DSSST1 safetensors payload"):
        decode_dssst1(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(WireError, match="DSSST1 dict keys must be strings"):
        encode_dssst1({1: torch.ones(1)})


class Gadget:
    """An arbitrary object: what a weights-only load must refuse."""


def test_torch_decoding_loads_plain_data_only() -> None:
    buffer = io.BytesIO()
    torch.save({"x": Gadget()}, buffer)
    with pytest.raises(WireError, match="not a plain-data torch.save payload"):
        decode_torch(buffer.getvalue())
    assert decode_torch(encode_torch({"metrics": {"loss": [1.0, 2.0]}}))["metrics"]["loss"] == [1.0, 2.0]
