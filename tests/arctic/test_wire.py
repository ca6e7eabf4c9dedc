"""Arctic's body encodings: round trips, the byte layout peers rely on, and refusals."""

from __future__ import annotations

import collections
import io
import json
import os
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


def frame_whose_length_reads_as_a_pickle() -> tuple[bytes, dict[str, object]]:
    """A valid DSSST1 frame whose 8-byte header length (640 = 0x0280) starts with pickle protocol 2's signature."""
    for size in range(2000):
        payload = {"x": torch.ones(2), "pad": "a" * size}
        body = encode_dssst1(payload)
        if body[:2] == b"\x80\x02":
            return body, payload
    raise AssertionError("no such frame")


def test_a_frame_whose_header_length_looks_like_a_pickle_is_still_a_frame() -> None:
    body, payload = frame_whose_length_reads_as_a_pickle()
    assert _equal(decode_dssst1(body), payload)


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


class Shell:
    """Unpickles to a shell command: the classic pickle attack."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("true",))


def test_torch_decoding_loads_plain_data_only() -> None:
    assert decode_torch(encode_torch({"metrics": {"loss": [1.0, 2.0]}}))["metrics"]["loss"] == [1.0, 2.0]
    for hostile, name in (
        (Gadget(), f"{__name__}.Gadget"),
        (Shell(), "posix.system"),
        (collections.deque([1]), "collections.deque"),
    ):
        buffer = io.BytesIO()
        torch.save({"batch": {"x": hostile}}, buffer)
        with pytest.raises(WireError, match=f"refusing to unpickle {name}: an Arctic v0.1 payload holds only"):
            decode_torch(buffer.getvalue())


def test_torch_decoding_accepts_the_defaultdict_of_arctics_multi_rank_merge_as_a_plain_dict() -> None:
    # What rl/utils/batch.py merge_dict_shards builds when a forward ran on several data-parallel ranks.
    merged: collections.defaultdict[str, object] = collections.defaultdict(list)
    merged["logprobs"] = torch.randn(4, 6)
    merged["tags"] = ["a", "b"]
    decoded = decode_torch(encode_torch({"job_id": 2, "batch": merged, "metrics": collections.defaultdict(list)}))
    assert type(decoded["batch"]) is dict and type(decoded["metrics"]) is dict
    assert torch.equal(decoded["batch"]["logprobs"], merged["logprobs"]) and decoded["batch"]["tags"] == ["a", "b"]
    with pytest.raises(KeyError):
        decoded["batch"]["entropy"]  # a defaultdict would have made an empty list up


def test_torch_decoding_leaves_the_process_allowlist_as_it_found_it() -> None:
    before = torch.serialization.get_safe_globals()
    decode_torch(encode_torch({"batch": collections.defaultdict(list)}))
    assert set(map(repr, torch.serialization.get_safe_globals())) == set(map(repr, before))
    torch.serialization.add_safe_globals([list])  # a user's own allowance survives our decoding
    try:
        decode_torch(encode_torch({"batch": collections.defaultdict(list)}))
        assert list in torch.serialization.get_safe_globals()
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
