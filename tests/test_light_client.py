"""What verl-remote leaves out of verl's work a step gives verl's results: one forwarder's batch balanced without
verl's partitioning (the same order and metrics), a forwarder's fetch narrowed to the batch's tensors; and a run
that waits for its service says so."""

from __future__ import annotations

import random
from typing import Any

import pytest


@pytest.mark.parametrize("samples", [1, 7, 64, 512, 4096])
def test_verls_partitioning_for_one_rank_is_every_sample_in_order(samples: int) -> None:
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions, log_seqlen_unbalance

    rng = random.Random(samples)
    seqlens = [rng.randint(1, 4096) for _ in range(samples)]
    import torch

    workload = calculate_workload(torch.tensor(seqlens, dtype=torch.int64))
    partitions = get_seqlen_balanced_partitions(workload, k_partitions=1, equal_size=True)
    assert partitions == [list(range(samples))]  # what RemotePPOTrainer._balance_batch takes without computing it
    ours = log_seqlen_unbalance(seqlen_list=seqlens, partitions=[list(range(samples))], prefix="global_seqlen")
    assert ours == log_seqlen_unbalance(seqlen_list=seqlens, partitions=partitions, prefix="global_seqlen")


def test_a_forwarder_gets_the_batchs_tensor_fields_and_verls_settings() -> None:
    from transfer_queue.metadata import KVBatchMeta

    from verl_remote.integration.forwarder_view import TensorFieldsOnly

    calls = []

    class Group:
        def __init__(self) -> None:
            self._dispatch_info = {"actor": [0]}

        def update_actor(self, batch: KVBatchMeta) -> str:
            calls.append(batch)
            return "done"

        def save_checkpoint(self, batch: KVBatchMeta) -> str:
            calls.append(batch)
            return "saved"

    group = TensorFieldsOnly(Group())
    meta = KVBatchMeta(
        keys=["a_0_0", "b_0_0"],
        tags=[{"seq_len": 3}, {"seq_len": 5}],
        partition_id="train",
        fields=["input_ids", "raw_prompt", "responses", "extra_info"],
        extra_info={"mini_batch_size": 2},
    )
    group._known.update({"input_ids": True, "responses": True, "raw_prompt": False, "extra_info": False})
    assert group.update_actor(meta) == "done"
    assert calls[-1].fields == ["input_ids", "responses"] and calls[-1].keys == meta.keys
    assert calls[-1].extra_info is meta.extra_info and calls[-1].tags == meta.tags
    assert meta.fields == ["input_ids", "raw_prompt", "responses", "extra_info"]  # the trainer's batch as it was
    assert group.save_checkpoint(meta) == "saved" and calls[-1] is meta  # other calls untouched
    assert group._dispatch_info == {"actor": [0]}


def test_a_run_waiting_for_its_service_says_so_and_when_it_answered(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading
    import types
    from concurrent.futures import Future
    from concurrent.futures import TimeoutError as FutureTimeout

    from verl_remote.integration import trainer

    clock = types.SimpleNamespace(now=0.0)
    monkeypatch.setattr(trainer, "time", types.SimpleNamespace(monotonic=lambda: clock.now))
    every = trainer.WAIT_NOTE_S
    answers_at = 3 * every + 5  # the service answers 5 s after the trainer's third note

    class Service(Future[Any]):
        """The backend being made, on the test's clock: a wait for it moves the clock on by its timeout, or to
        the moment the service answers, so the notes are decided by these times alone."""

        def result(self, timeout: float | None = None) -> Any:
            assert timeout == every
            if clock.now + timeout < answers_at:
                clock.now += timeout
                raise FutureTimeout
            clock.now = start.ready_at = answers_at  # as BackendStart's thread records it
            return "the backend"

    start = trainer.BackendStart.__new__(trainer.BackendStart)  # its thread's part played by Service
    start._lock, start._taken, start._made = threading.Lock(), False, Service()
    start.began = start.ready_at = clock.now
    assert start.take() == "the backend"
    assert capsys.readouterr().out.splitlines() == [
        *(f"verl-remote: waiting for the service ({k * every:.0f} s)" for k in (1, 2, 3)),
        f"verl-remote: the service answered after {answers_at:.0f} s",
    ]
    quick = trainer.BackendStart.__new__(trainer.BackendStart)
    quick._lock, quick._taken, quick._made = threading.Lock(), False, Future()
    quick.began = quick.ready_at = clock.now
    quick._made.set_result("at once")
    assert quick.take() == "at once" and capsys.readouterr().out == ""  # nothing said when nothing was waited for


def test_a_forwarders_one_mini_batch_is_verls_and_more_are_verls_own() -> None:
    import torch
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    from verl_remote.integration.worker import _mini_batches

    lengths = [3, 5, 2, 7, 4, 6]
    rows = [torch.arange(n, dtype=torch.float32) + i for i, n in enumerate(lengths)]
    batch = TensorDict(
        {"x": torch.nested.as_nested_tensor(rows, layout=torch.jagged), "y": torch.arange(6.0)}, batch_size=[6]
    )

    def flat(batches: Any) -> list[list[list[float]]]:
        return [[[v.tolist() for v in b["x"].unbind()], b["y"].tolist()] for b in batches]

    for size, epochs, shuffle in ((6, 1, False), (8, 1, False), (3, 1, False), (6, 2, False), (6, 1, True)):
        kwargs = {"shuffle": shuffle}
        theirs = tu.make_iterator(batch, mini_batch_size=min(size, 6), epochs=epochs, seed=1, dataloader_kwargs=kwargs)
        assert flat(_mini_batches(batch, size, epochs, 1, kwargs)) == flat(theirs), (size, epochs, shuffle)
