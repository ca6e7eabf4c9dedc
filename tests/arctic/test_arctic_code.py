"""Arctic's own batch code, from its pinned releases, run on our payloads and compared with our model of it.

The test server splits batches across ranks and micro-batches and merges the
answers with :mod:`verl_arctic.testing.batching`; here Arctic's functions
(arctic-platform 0.1.2 ``rl/utils/batch.py``, 0.1.4 ``common/utils/batch.py``)
run on the dense batches verl-arctic's forwarder builds, and both must agree
on every part, container and number. The client must decode whatever
Arctic's merge builds. Arctic's code runs in this process but is never
installed in it (tests/arctic/real/vendor.py).
"""

from __future__ import annotations

import collections
import copy
import random
from typing import Any

import pytest
import torch
from conversation import forward_payload, update_payload
from real.vendor import arctic_module
from tensordict import TensorDict

from verl_arctic import wire
from verl_arctic.testing.batching import combine_microbatch_metrics, combine_rank_metrics, merge_shards, split_rows
from verl_arctic.worker import to_dense

pytestmark = pytest.mark.arctic_real

BATCH_MODULE = {"v0.1": "arctic_platform.rl.utils.batch", "main": "arctic_platform.common.utils.batch"}
GENERATIONS = ["v0.1", "main"]


def _same(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs), (type(ours), type(theirs))
    if isinstance(ours, torch.Tensor):
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
    elif isinstance(ours, dict):
        assert list(ours) == list(theirs)
        for key in ours:
            _same(ours[key], theirs[key])
    elif isinstance(ours, list | tuple):
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs, strict=True):
            _same(a, b)
    else:
        assert ours == theirs


def _verl_rows(rows: int, seed: int) -> dict[str, torch.Tensor]:
    """A dense batch as verl-arctic's forwarder makes it from verl's jagged rows."""
    rng = random.Random(seed)
    prompts = [torch.tensor([rng.randrange(3, 20) for _ in range(rng.randint(2, 6))]) for _ in range(rows)]
    responses = [torch.tensor([rng.randrange(3, 20) for _ in range(rng.randint(1, 5))]) for _ in range(rows)]
    data = TensorDict(
        {
            "prompts": torch.nested.as_nested_tensor(prompts, layout=torch.jagged),
            "responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged),
        },
        batch_size=[rows],
    )
    batch, _, _, _ = to_dense(data, 0)
    return batch


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize(("rows", "parts"), [(8, 1), (8, 2), (8, 4), (6, 4), (5, 2), (3, 3), (2, 4)])
def test_batches_split_across_ranks_and_micro_batches_as_arctic_splits_them(
    generation: str, rows: int, parts: int
) -> None:
    batch = _verl_rows(rows, seed=rows * 10 + parts) | {"tags": [f"row{i}" for i in range(rows)], "note": "kept"}
    with arctic_module(generation, BATCH_MODULE[generation]) as arctic:
        try:
            theirs: Any = arctic.split_dict(copy.deepcopy(batch), parts)
        except (ValueError, IndexError) as exc:
            theirs = exc
    try:
        ours: Any = split_rows(copy.deepcopy(batch), parts, generation)
    except (ValueError, IndexError) as exc:
        ours = exc
    if isinstance(theirs, Exception):
        # Too few rows, or (v0.1) torch.chunk making fewer parts than asked: the same error, the same words.
        assert type(ours) is type(theirs) and str(ours) == str(theirs)
        return
    _same(ours, theirs)


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_answers_of_ranks_merge_into_the_same_containers_and_the_client_decodes_them(
    generation: str, ranks: int
) -> None:
    rng = torch.Generator().manual_seed(ranks)
    answers = [
        {
            "logprobs": torch.randn(2, 7, generator=rng),
            "entropy": torch.rand(2, 7, generator=rng),
            "ids": [i, i + 1],
            "count": i,
        }
        for i in range(ranks)
    ]
    with arctic_module(generation, BATCH_MODULE[generation]) as arctic:
        theirs = arctic.merge_dict_shards(copy.deepcopy(answers))
    ours = merge_shards(copy.deepcopy(answers))
    _same(ours, theirs)
    if ranks > 1:
        assert type(theirs) is collections.defaultdict  # what a v0.1 forward on several ranks pickles
    # verl-arctic's client reads Arctic's own merge off the wire, without unpickling anything else.
    decoded = wire.decode_torch(wire.encode_torch({"job_id": 3, "batch": theirs, "metrics": {}}))
    assert type(decoded["batch"]) is dict
    _same(decoded["batch"], dict(theirs))


def _metrics(rng: random.Random) -> dict[str, Any]:
    tokens = float(rng.randint(0, 9))
    out: dict[str, Any] = {
        "actor/pg_loss.sum": rng.uniform(-2, 2),
        "actor/pg_loss.tokens": tokens,
        "loss.sum": rng.uniform(-2, 2),
        "loss.tokens": tokens,
        "kl_coef": 0.001,
        "grad_norm": rng.uniform(0, 3),
        "sample_count": rng.randint(1, 5),
        "flag": rng.random() < 0.5,
        "note": "text",
    }
    if rng.random() < 0.5:
        out["only.sum"] = 1.0  # a .sum without its .tokens is a plain number
    return out


@pytest.mark.parametrize("generation", GENERATIONS)
@pytest.mark.parametrize("seed", range(6))
def test_metrics_fold_over_micro_batches_and_ranks_as_arctic_folds_them(generation: str, seed: int) -> None:
    rng = random.Random(seed)
    per_rank = [[_metrics(rng) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 3))]
    with arctic_module(generation, BATCH_MODULE[generation]) as arctic:
        their_ranks = [arctic.combine_metric_microbatches(copy.deepcopy(m)) for m in per_rank]
        theirs = arctic.combine_metric_shards(copy.deepcopy(their_ranks))
    our_ranks = [combine_microbatch_metrics(copy.deepcopy(m), generation) for m in per_rank]
    ours = combine_rank_metrics(copy.deepcopy(our_ranks), generation)
    assert set(ours) == set(theirs)
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key]), key


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_load_balancer_reordering_does_not_show_in_forward_answers(ranks: int) -> None:
    """Arctic's load balancer reorders rows across ranks and restores the order of forward outputs; the test
    server skips both, which is only right if a client cannot tell. Run Arctic's own split and restore."""
    payload = update_payload(8, 0, load_balancer=True)
    payload["batch"] = _verl_rows(8, seed=ranks) | {"row": torch.arange(8)}
    with arctic_module("v0.1", BATCH_MODULE["v0.1"]) as arctic:
        shards, order = arctic._split_batch(copy.deepcopy(payload), ranks)
        merged = arctic.merge_dict_shards([{"row": shard["batch"]["row"]} for shard in shards])
        restored = arctic.restore_batch_order(merged, order)
    assert torch.equal(restored["row"], torch.arange(8))


def _payloads() -> list[Any]:
    from test_wire import PAYLOAD, frame_whose_length_reads_as_a_pickle

    return [
        PAYLOAD,
        update_payload(4, 0),
        forward_payload(3, 0),
        {"prompts": ["say 7"], "sampling_params": {"max_tokens": 4}},  # no tensors at all
        frame_whose_length_reads_as_a_pickle()[1],
    ]


@pytest.mark.parametrize("index", range(5))
def test_dssst1_frames_travel_both_ways_between_arctics_codec_and_ours(index: int) -> None:
    payload = _payloads()[index]
    with arctic_module("main", "arctic_platform.wire") as arctic:
        _same(arctic.loads(wire.encode_dssst1(payload)), wire.decode_dssst1(arctic.dumps(payload)))
        _same(wire.decode_dssst1(arctic.dumps(payload)), wire.decode_dssst1(wire.encode_dssst1(payload)))
        for hostile in (wire.encode_torch({"a": torch.ones(1)}), b"\x80\x04garbage"):
            with pytest.raises(Exception, match="refusing to deserialize a legacy pickle"):
                arctic.loads(hostile)
            with pytest.raises(wire.WireError, match="refusing to deserialize a legacy pickle"):
                wire.decode_dssst1(hostile)
