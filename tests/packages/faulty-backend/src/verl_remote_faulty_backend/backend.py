"""The local backend, failing where remote_backend.fail_in says, recording its lifecycle calls."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
from typing import Any, ClassVar

import torch
from omegaconf import OmegaConf

from verl_remote import RemoteRolloutServer, SampleResult, SamplingParams, pack_fields
from verl_remote.backends.local.backend import LocalBackend
from verl_remote.backends.local.rollout import LocalRolloutReplica, LocalRolloutServer
from verl_remote.backends.local.worker import TRAIN_FIELDS, LocalForwarderWorker

#: The faulty backend's pretend service-side ledger, in the run's folder: the jobs it made there and holds.
LEDGER = "faulty-service-jobs.json"


class InjectedFailure(RuntimeError):
    pass


class FaultyBackend(LocalBackend):
    settings: dict[str, Any]
    #: Where its pretend service keeps the job it made (the leaves_a_job defect), or None.
    ledger: str | None

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> FaultyBackend:
        defect = main_config.remote_backend.get("defect")
        if handle is None and defect is not None and "samples_live_weights" in str(defect):
            # The engine built as for a synchronous run: no copy for sampling, whatever the run's mode.
            main_config = OmegaConf.merge(main_config, {"trainer": {"v1": {"trainer_mode": "remote"}}})
        backend = super().from_config(main_config, handle=handle)
        assert isinstance(backend, FaultyBackend)
        backend.settings = dict(main_config.remote_backend)
        backend.ledger = None
        if handle is None and backend.has_defect("leaves_a_job"):
            # A job made on its (pretend) service, which destroy forgets: only the service can tell it is there.
            backend.ledger = os.path.join(str(main_config.trainer.default_local_dir), LEDGER)
            os.makedirs(os.path.dirname(backend.ledger), exist_ok=True)
            with open(backend.ledger, "w") as fp:
                json.dump(["faulty job 1 (RUNNING)"], fp)
        return backend

    @classmethod
    def preflight(cls, main_config: Any) -> None:
        super().preflight(main_config)
        defect = main_config.remote_backend.get("defect")
        mode = str(main_config.actor_rollout_ref.actor.policy_loss.loss_mode)
        if defect is not None and "claims_vanilla_only" in str(defect) and mode != "vanilla":
            raise ValueError(
                f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}: the faulty backend trains the vanilla loss "
                "only; set actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"
            )

    async def left_on_service(self) -> list[str]:
        """The engine actor while Ray has it, and the jobs its pretend service's ledger holds."""
        left = await super().left_on_service()
        if self.ledger is not None and os.path.exists(self.ledger):
            with open(self.ledger) as fp:
                left += list(json.load(fp))
        return left

    def has_defect(self, name: str) -> bool:
        """remote_backend.defect: one defect's name, or a list of them."""
        defect = self.settings.get("defect")
        return defect is not None and (name == defect if isinstance(defect, str) else name in defect)

    def _maybe_fail(self, where: str) -> None:
        if self.settings.get("fail_in") == where:
            raise InjectedFailure(f"faulty backend: injected failure in {where}")

    def forward_backward(self, batch: Any, meta: dict[str, Any]) -> dict[str, float]:
        self._maybe_fail("forward_backward")
        metrics = super().forward_backward(batch, meta)
        if self.has_defect("no_loss_key"):
            # No defect for verl, which reads no metric by name: only verl's own (actor/pg_loss, ...), no 'loss'.
            metrics.pop("loss", None)
        return metrics

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Any:
        # In the rollout server's process: its sampler, failing from the given call on.
        self._generate_calls = getattr(self, "_generate_calls", 0) + 1
        if self._generate_calls > int(self.settings.get("fail_after_calls") or 0):
            self._maybe_fail("generate")
        return await super().generate(prompt_ids, params)

    def _record(self, call: str) -> None:
        log = self.settings.get("calls_log")
        if log:
            with open(log, "a") as fp:
                fp.write(f"{call} pid={os.getpid()}\n")

    async def update_weights(self) -> None:
        self._record("update_weights")
        hold = float(self.settings.get("hold_after_save_s") or 0.0)
        if hold and getattr(self, "_saved", False):
            await asyncio.sleep(hold)  # a slow step, so that a test's signal lands inside the run
        await super().update_weights()

    async def save_checkpoint(self, step: int, path: str) -> None:
        self._record(f"save_checkpoint {step}")
        await super().save_checkpoint(step, path)
        if self.has_defect("optimizer_not_saved"):  # the weights only: a load starts a fresh optimizer
            file = os.path.join(path, "local_engine", "local_engine.pt")
            state = torch.load(file, map_location="cpu", weights_only=True)
            state["optimizer"] = {"state": {}, "param_groups": state["optimizer"]["param_groups"]}
            torch.save(state, file)
        hold = float(self.settings.get("hold_in_save_s") or 0.0)
        if hold and getattr(self, "_saved", False):
            self._record(f"holding in save_checkpoint {step}")
            await asyncio.sleep(hold)  # a save caught midway, for tests that kill the run there
        self._saved = True

    async def load_checkpoint(self, step: int, path: str) -> None:
        self._record(f"load_checkpoint {step}")
        if not self.has_defect("load_nothing"):
            await super().load_checkpoint(step, path)

    async def destroy(self) -> None:
        self._record("destroy")
        await super().destroy()


class FaultyWorker(LocalForwarderWorker):
    backend: FaultyBackend

    def backend_forward_backward(self, mini_batch: Any, meta: dict[str, Any]) -> dict[str, float]:
        probe = self.backend.settings.get("env_probe")
        if probe:  # what the forwarder's process was given, not the value
            self.backend._record(f"forward_backward env {probe} {'set' if os.environ.get(probe) else 'unset'}")
        # remote_backend.batches_log: each row the backend trains on, its response and response mask, one JSON line.
        log = self.backend.settings.get("batches_log")
        if log:
            rows = zip(mini_batch["responses"].unbind(0), mini_batch["response_mask"].unbind(0), strict=True)
            with open(log, "a") as fp:
                for response, mask in rows:
                    fp.write(json.dumps({"responses": response.tolist(), "response_mask": mask.tolist()}) + "\n")
        if self.backend.has_defect("loss_fixed_at_creation"):
            # No defect where the configs agree (a run's do): the engine's loss, fixed from the config the backend
            # was made with, whatever this forwarder's actor config says.
            return self.backend.forward_backward(pack_fields(mini_batch, TRAIN_FIELDS), dict(meta))
        return super().backend_forward_backward(mini_batch, meta)

    def loss(self) -> dict[str, Any]:
        loss = super().loss()
        if self.backend.has_defect("ignores_clip"):  # the ratio never clipped, either way
            loss |= {"clip_ratio": 1e9, "clip_ratio_low": 1e9, "clip_ratio_high": 1e9, "clip_ratio_c": 1e10}
        if self.backend.has_defect("per_sequence"):  # each sequence's mean, then the mean over sequences
            per_token = loss["loss_agg_mode"] == "token-mean"
            loss["loss_agg_mode"] = "seq-mean-token-mean" if per_token else "token-mean"
        if self.backend.has_defect("vanilla_always"):  # whatever loss_mode says
            loss["policy_loss"] = {**loss["policy_loss"], "loss_mode": "vanilla"}
        return loss

    def backend_log_probs(
        self, data: Any, *, temperature: float, calculate_entropy: bool, reference: bool
    ) -> tuple[Any, Any]:
        log_probs, entropy = super().backend_log_probs(
            data, temperature=temperature, calculate_entropy=calculate_entropy, reference=reference
        )
        if self.backend.has_defect("shifted_log_probs"):
            # Position t holds log p(token t+2): each row one position early, its last still 0.
            rows = [torch.cat([row[1:], row.new_zeros(1)]) for row in log_probs.unbind(0)]
            log_probs = torch.nested.nested_tensor(rows, layout=torch.jagged)
        elif self.backend.has_defect("pad_log_prob_at_end"):
            # Not a defect for verl, which never reads a row's last position: a service that scores a padding
            # token there. The checks must pass it.
            rows = [torch.cat([row[:-1], row.new_full((1,), -2.5)]) for row in log_probs.unbind(0)]
            log_probs = torch.nested.nested_tensor(rows, layout=torch.jagged)
        return log_probs, entropy


class FaultyServer(LocalRolloutServer):
    backend: FaultyBackend

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        if self.backend.has_defect("greedy_ignored") and params.temperature == 0:
            params = dataclasses.replace(params, temperature=1.0)  # samples where verl's validation asks greedy
        if self.backend.has_defect("temperature_ignored") and params.temperature > 0:
            params = dataclasses.replace(params, temperature=1.0)  # samples and scores at 1 whatever verl asks
        return await super().sample(prompt_ids, params)


class FaultyReplica(LocalRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = FaultyServer
