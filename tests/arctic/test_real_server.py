"""Arctic's own released server, run on CPU, against our test server and against verl-arctic.

Arctic's real HTTP server application (arctic-platform 0.1.2 for protocol
v0.1, 0.1.4 for main) runs in its own environment with its DeepSpeed workers
on DeepSpeed's CPU accelerator; only the vLLM sampling pool and a few CUDA
device queries are stood in for (tests/arctic/real/harness). Then:

- the same conversation (tests/arctic/conversation.py: every route, the
  requests that succeed and the mistakes a client can make) is held with
  Arctic's server and with ours, and every answer must agree in status, body
  kind and shape, containers included; a disagreement fails naming the step;
- ``verl-remote train remote_backend=arctic`` trains against Arctic's server.

Steps the CPU cannot answer as a GPU server would are left out of the
comparison and listed in :data:`NOT_ON_CPU`, with the reason.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conversation import TRAINING_RANKS, Observation, converse
from real.vendor import real_arctic_server

from conftest import (
    KL_RECIPE,
    arctic_jobs,
    finish,
    free_port,
    last_line,
    metric,
    read_until,
    run_log,
    serving_test_server,
    start,
    step_row,
    steps,
)
from verl_remote.demo.assets import ensure_demo_assets

pytestmark = pytest.mark.arctic_real

#: Steps whose answer on a CPU is not the GPU server's: none at present.
NOT_ON_CPU: dict[str, str] = {}


#: The log-prob engine each generation's Arctic server runs in the harness, and so ours: on main Arctic's default,
#: ``--log-prob-engine vllm`` (arctic-platform 0.1.4 common/http_server.py:1010-1013, its pool made at 1076-1079;
#: tests/arctic/real/harness/serve.py:146), on v0.1 ``deepspeed`` (serve.py:115, as that harness has always run it).
LOG_PROB_ENGINE = {"v0.1": "deepspeed", "main": "vllm"}


def _ours(generation: str, workdir: Path, next_job: int) -> list[Observation]:
    with serving_test_server(
        generation,
        training_gpus=TRAINING_RANKS,
        sampling_gpus=1,
        log_prob_gpus=1,
        log_prob_engine=LOG_PROB_ENGINE[generation],
        colocate=generation == "main",
    ) as url:
        following = 1  # a server's first job after its start
        while following < next_job:
            following = _next_job(url)
        return list(converse(url, generation, _model(), workdir))


def _next_job(url: str) -> int:
    """The id the server hands out next, found by making a sampling job and destroying it (which uses that id:
    one more is the next). Job ids are part of what the conversation compares, and a server numbers its jobs
    from 1 after each start."""
    made = httpx.post(f"{url}/initialize", json={"model_name": _model(), "job_type": "sampling"}, timeout=300)
    assert made.status_code == 200, made.text
    job = int(made.json()["job_id"])
    gone = httpx.post(f"{url}/destroy", params={"job_id": job}, json={"job_type": "sampling"}, timeout=300)
    assert gone.status_code == 200, gone.text
    return job + 1


def _model() -> str:
    return str(ensure_demo_assets().model_path)


class Arctic:
    """Arctic's own server of one generation on a port of its own, with its log; :meth:`restart` replaces it (on
    the same port: to a client, the same server restarted)."""

    def __init__(self, generation: str, log: Path) -> None:
        self.generation, self.log = generation, log
        self._stack = contextlib.ExitStack()
        self.port = free_port()
        self.url = ""

    def start(self) -> None:
        server = real_arctic_server(self.generation, self.port, training_gpus=TRAINING_RANKS, log=self.log)
        self.url = self._stack.enter_context(server)

    def restart(self) -> None:
        self.stop()
        self.start()

    def stop(self) -> None:
        self._stack.close()


@pytest.fixture(scope="module", params=["v0.1", "main"])
def arctic(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Arctic]:
    """Arctic's own server of one generation, started once for the module (about half a minute each); every
    test leaves it holding no job. The run comes first, on the fresh server (a dead run's ids are the ones it
    hands out after a start), then the conversation."""
    generation = str(request.param)
    server = Arctic(generation, tmp_path_factory.mktemp(f"arctic-real-{generation}") / "arctic-server.log")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _backend(folder: Path, *overrides: str) -> Any:
    """verl-arctic's backend as a run's driver makes it: the jobs created, recorded in ``folder``."""
    from verl_arctic.backend import ArcticBackend
    from verl_remote.demo import resolve_demo_assets
    from verl_remote.discovery.compose import compose_config

    config = compose_config([*overrides, f"trainer.default_local_dir={folder}"], recipe="demo")
    resolve_demo_assets(config)
    return ArcticBackend.from_config(config)


def _on(arctic: Arctic) -> tuple[str, ...]:
    """verl-arctic's settings for Arctic's own server: its URL, its training ranks, an attention CPU runs."""
    return (
        f"remote_backend.comms.url={arctic.url}",
        f"remote_backend.training_gpus={TRAINING_RANKS}",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
    )


@pytest.mark.train
@pytest.mark.faults
def test_verl_remote_trains_against_arctics_own_server_and_a_resume_beside_it_leaves_its_jobs(
    arctic: Arctic, tmp_path: Path, caplog: pytest.LogCaptureFixture, cli_main: Any
) -> None:
    """Two data-parallel DeepSpeed ranks, two micro-batches each: Arctic's merges travel to the client. The policy
    loss is not Arctic's (gspo on v0.1, cispo summed over tokens on main): each update a forward pass and verl's
    gradient carried through Arctic's verl_grpo.

    On protocol v0.1, with a KL penalty (a reference job beside the training job) and a save at step 2, which a
    later run cannot resume: v0.1 has no load-checkpoint call, and the run is refused before anything starts.

    On the current protocol (main), before it, a run was killed and Arctic restarted: that run's record names the
    ids Arctic hands this run (the module's server is fresh, so the dead run's ids are the first ones a server
    hands out after a start). The dead run's folder is resumed while this one trains: its resume leaves this
    run's jobs alone (it says so, and cannot start beside them), and this run goes on to its end. (Job identity
    is the same code for both generations, tested for both against the test server in test_protocol.py; the KL
    penalty, saves and resumes on main: tests/arctic/test_arctic_train.py.)
    """
    from verl_arctic.client import ArcticError
    from verl_arctic.record import JOBS_FILE
    from verl_remote.testing.proxy import Fault, FaultProxy

    settings = [
        "remote_backend=arctic",
        *_on(arctic),
        # A policy loss Arctic's verl_grpo is not: verl's gradient carried through it (verl_arctic.loss), with an
        # aggregation its servers do not name on main.
        *(
            ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo"]
            if arctic.generation == "v0.1"
            else [
                "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
                "actor_rollout_ref.actor.loss_agg_mode=token-sum",
            ]
        ),
    ]
    dead = tmp_path / "dead"
    beside_a_dead_run = arctic.generation == "main"
    kl_and_a_save = [*KL_RECIPE, "trainer.save_freq=2"]
    if beside_a_dead_run:
        _backend(dead, *settings).client.close()  # killed: its jobs stay on the server, recorded in its folder
        recorded = json.loads((dead / JOBS_FILE).read_text())["jobs"]
        arctic.restart()

    saves = ["trainer.save_freq=2"] if beside_a_dead_run else kl_and_a_save
    # Through a proxy of the tests' own that answers the run's first /generate with a load balancer's 502: the
    # requests it carried are sent again, and the step goes on (restarts: tests/arctic/test_arctic_train.py).
    proxy = FaultProxy(arctic.url).start()
    proxy.inject(Fault("/generate", 502, body={"detail": "Bad Gateway"}))
    through = [
        f"remote_backend.comms.url={proxy.url}" if s.startswith("remote_backend.comms.url=") else s for s in settings
    ]
    proc = start(tmp_path, *saves, *through, "trainer.total_training_steps=2")
    seen = ""
    try:
        seen = "".join(read_until(proc, step_row(1)))
        if beside_a_dead_run:
            held = arctic_jobs(arctic.url)
            assert set(held) == {str(job) for job in recorded.values()}  # the dead run's ids are this run's jobs now
            caplog.set_level(logging.WARNING, logger="verl_arctic.record")
            with pytest.raises(ArcticError, match="HTTP 409: .*The server holds another run's sampling job"):
                _backend(dead, *settings)
            assert arctic_jobs(arctic.url) == held
            for kind, job in recorded.items():
                assert any(
                    f"left {kind} job {job} on {arctic.url} alone" in r.getMessage()
                    and "the server restarted and another run holds that id" in r.getMessage()
                    for r in caplog.records
                ), caplog.text[-3000:]
    finally:
        out = seen + finish(proc)
        proxy.stop()
    assert proc.returncode == 0, out[-5000:]
    assert steps(out)[-2:] == [1, 2]
    log = run_log(tmp_path / "ckpt")
    assert proxy.answered("/generate") == 1
    retried = metric(log, "verl_remote/sample_retries")
    assert retried[0] >= 1 and sum(retried[1:]) == 0, retried
    assert "verl-remote: restart " not in out
    # The sampler had the trained weights each step: its token probabilities are the trainer's within what the two
    # engines' arithmetic allows. Nothing tighter holds against this server: Arctic's engines train and score in
    # bf16 (0.1.4 common/deepspeed_worker.py:293 and 301 set bf16 and a bf16 autocast unless the client asks
    # fp16) while the stand-in sampler runs float32 (real/harness/stand_ins/arctic_inference/server/
    # replica_pool.py:87), and without flash-attention Arctic's packed forward lets a row attend to the row before
    # it in its micro-batch (docs/measurements.md, "Arctic's own server"): 0.016-0.022 at most, 0.002 on average,
    # measured here (0.003-0.014 at most with one rank). A weight sync that leaves the sampler on the initial
    # weights is a gap of 0.070 at most and 0.012 on average at step 2 (measured against the test server, whose
    # sync was made a no-op, with this run's settings; the first update's size is Adam's, whatever the loss): the
    # bounds sit about halfway, twice the noise.
    diffs = metric(log, "training/rollout_probs_diff_max")
    means = metric(log, "training/rollout_probs_diff_mean")
    assert len(diffs) == len(means) == 2, (diffs, means)
    assert max(diffs) < 0.045 and max(means) < 0.006, (diffs, means)
    # Each step trained once (the requests of the /generate the proxy failed were sent again, not trained twice):
    # Arctic's DeepSpeed engine counted one optimizer step a step (the demo's batch is one mini-batch) and the 64
    # sequences of each (8 prompts x 8 responses).
    assert _deepspeed_counts(tmp_path / "ckpt", arctic.generation) == (2, 2 * 64)
    assert arctic_jobs(arctic.url) == {}
    if beside_a_dead_run:
        # The step-2 checkpoint out as a Hugging Face folder by Arctic's own /save with export_hf, from a training
        # job the export makes, loads the step into and destroys (Arctic's server writes no tokenizer: the run's).
        out = tmp_path / "hf"
        # (The run recorded the proxy's address: the export is told the server's.)
        direct = f"remote_backend.comms.url={arctic.url}"
        code, said, err = cli_main("export", str(tmp_path / "ckpt"), "--out", str(out), direct)
        assert code == 0, err[-3000:]
        assert f"verl-remote: exported step 2 to {out} (" in said
        assert arctic_jobs(arctic.url) == {}
        _assert_trained_export(out)
        return

    kl = metric(log, "actor/kl_loss")
    # The reference kept the initial weights while training moved away: at step 1 both jobs score the initial
    # weights (alike within the two DeepSpeed engines' numerics: 7e-4 measured; 0 on the test server).
    assert kl[0] < 5e-3 and kl[1] > 4 * kl[0], kl
    pointer = json.loads((tmp_path / "ckpt" / "global_step_2" / "actor" / "arctic_checkpoint.json").read_text())
    assert pointer["step"] == 2 and pointer["generation"] == "v0.1" and Path(pointer["path"]).is_dir()
    code, _out, err = cli_main(
        "train", *settings, "trainer.total_training_steps=3", f"trainer.default_local_dir={tmp_path / 'ckpt'}"
    )
    assert code == 2, err[-3000:]  # refused before anything starts (cli_main fails if Ray started)
    assert f"Arctic protocol v0.1 at {arctic.url}" in last_line(err) and "has no load-checkpoint call" in last_line(err)
    assert "set trainer.resume_mode=disable to start over" in last_line(err)
    direct = f"remote_backend.comms.url={arctic.url}"
    code, _out, err = cli_main("export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), direct)
    assert code == 2, err[-3000:]
    assert "the run saved step 2 on Arctic protocol v0.1, which cannot export it" in last_line(err), err[-3000:]
    assert arctic_jobs(arctic.url) == {}


@pytest.mark.train
@pytest.mark.parametrize("arctic", ["main"], indirect=True)  # v0.1 has no checkpoint load, which the check needs
def test_the_gradient_check_proves_every_loss_verl_has_on_arctics_own_bf16_server(
    arctic: Arctic, ray_instance: Any
) -> None:
    """verl-arctic on Arctic's own 0.1.4 server, which trains in bf16: each of verl's policy losses, aggregations
    and its KL loss, carried as verl_arctic.loss carries it, makes the update verl's gradient makes, within 5 % of
    its move: the probe trains on the update's own rows (verl_remote.testing.gradient.own_rows_batch). Only the
    checks the gradient check builds on run before it (the others compare log-probs across engines of different
    arithmetic: docs/measurements.md)."""
    from verl_remote.testing import Conformance
    from verl_remote.testing.gradient import every_loss

    overrides = _on(arctic)
    conformance = Conformance("arctic", overrides, losses=every_loss(), precision="bf16")
    try:
        for needed in ("spec", "from_config", "worker_reattaches", "sampler_reattaches", "training_step"):
            getattr(conformance, f"check_{needed}")()  # (a save before any step is one Arctic cannot load)
        said = conformance.check_gradient()
    finally:
        conformance.close()
    shares = re.fullmatch(
        rf"{len(every_loss())} losses: verl's update within (\S+)% of its move \(by the norm, the probe on the "
        r"update's own rows; 5% allowed for bf16\), the farthest .*",
        said,
    )
    assert shares is not None, said
    assert arctic_jobs(arctic.url) == {}


@pytest.mark.train
@pytest.mark.parametrize("arctic", ["v0.1"], indirect=True)
def test_every_loss_verl_has_trains_an_update_on_arctics_own_v0_1_server(arctic: Arctic, ray_instance: Any) -> None:
    """Protocol v0.1 (arctic-platform 0.1.2) has no checkpoint load, which the gradient check needs (it compares
    two updates from one saved state: on main, above). There each of verl's 17 losses trains one update as a run
    sends it, through verl-arctic's forwarder (Arctic's verl_grpo in one pass, or verl's gradient carried through
    it), one after another: Arctic takes each, and the log-probs move and stay finite."""
    import numpy as np
    import ray

    from verl_remote.testing import Conformance
    from verl_remote.testing.gradient import LossUnderTest, every_loss, loss_label, with_settings
    from verl_remote.testing.rows import responses_of

    overrides = _on(arctic)
    conformance = Conformance("arctic", overrides)
    try:
        for needed in ("spec", "from_config", "worker_reattaches", "sampler_reattaches"):
            getattr(conformance, f"check_{needed}")()
        worker = conformance.state.worker
        rows, responses = conformance._gradient_rows()
        lengths = [len(r) for r in responses]
        actor = conformance.state.config.actor_rollout_ref.actor
        before = conformance._log_probs(rows, lengths)
        for settings in every_loss():
            under = LossUnderTest(settings, with_settings(actor, settings), rows, responses, before)
            fields, meta = under.mini_batch()
            ray.get(worker.use_actor.remote(settings), timeout=600)
            conformance._update(rows, responses, fields, [[1] * len(r) for r in responses], meta)
            after = conformance._log_probs(rows, lengths)
            moved = float(np.abs(np.concatenate(responses_of(after - before, rows, responses))).max())
            assert np.isfinite(after).all() and moved > 0, (loss_label(settings, under.actor), moved)
            before = after
    finally:
        conformance.close()
    assert arctic_jobs(arctic.url) == {}


def test_our_test_server_answers_every_route_as_arctics_own_server(arctic: Arctic, tmp_path: Path) -> None:
    generation = arctic.generation
    next_job = _next_job(arctic.url)  # after the run above: both servers number the conversation's jobs alike
    theirs = list(converse(arctic.url, generation, _model(), tmp_path / "real"))
    ours = _ours(generation, tmp_path / "ours", next_job)
    assert [o.step for o in ours] == [o.step for o in theirs]
    differences = []
    for mine, real in zip(ours, theirs, strict=True):
        if mine.step in NOT_ON_CPU:
            continue
        if (mine.status, mine.kind, mine.shape) != (real.status, real.kind, real.shape):
            differences.append(
                f"{mine.step}:\n  Arctic: {real.status} {real.kind} {json.dumps(real.shape, default=str)[:600]}"
                f"\n  ours:   {mine.status} {mine.kind} {json.dumps(mine.shape, default=str)[:600]}"
            )
    assert not differences, f"{len(differences)} of {len(theirs)} answers differ:\n" + "\n".join(differences)
    assert arctic.log.stat().st_size > 0
    assert arctic_jobs(arctic.url) == {}
    if generation == "v0.1":
        # Arctic v0.1 keeps the workers of a training initialize that fails after starting them (the
        # conversation's "training without a checkpoint path": ray_server.py asserts the path only after the
        # workers start), so no training job starts on that server again: this test comes last.
        assert theirs[-1].step == "training after that" and theirs[-1].status != 200


def _deepspeed_counts(ckpt: Path, generation: str) -> tuple[int, int]:
    """(optimizer steps, samples they took) as Arctic's DeepSpeed engine counted them, from the step-2 checkpoint the
    run saved: DeepSpeed's ``global_steps`` and ``global_samples`` (deepspeed 0.19.8 runtime/engine.py:3558-3565,
    advanced with each optimizer step), saved in the model states beside the optimizer's (engine.py:5031-5033)."""
    import torch

    pointer = json.loads((ckpt / "global_step_2" / "actor" / "arctic_checkpoint.json").read_text())
    assert pointer["step"] == 2 and pointer["generation"] == generation, pointer
    folder = Path(pointer["path"])
    tag = (folder / "latest").read_text().strip()  # DeepSpeed's tag of the newest save in the folder
    states = torch.load(folder / tag / "mp_rank_00_model_states.pt", weights_only=True, map_location="cpu")
    assert states["skipped_steps"] == 0, states["skipped_steps"]
    return int(states["global_steps"]), int(states["global_samples"])


def _assert_trained_export(out: Path) -> None:
    """A model folder transformers loads, with the tokenizer, whose weights training moved from the initial
    model's. (Its log-probs are not compared with the server's: Arctic's engines compute in bf16 whatever the client
    asks, and /save's export writes the fp32 master weights, arctic-platform 0.1.4 common/deepspeed_worker.py:625-656;
    the test server, fp32, shows the equality: tests/arctic/test_arctic_check.py.)"""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    AutoTokenizer.from_pretrained(out)
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(_model(), dtype=torch.float32).state_dict()
    assert exported.keys() == initial.keys()
    moved = max((exported[name] - weight).abs().max().item() for name, weight in initial.items())
    assert moved > 0, moved
