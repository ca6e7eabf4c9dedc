"""The run's one Tinker session: a Ray actor that holds the SDK's clients and every request of the run.

The Tinker API orders a training client's requests by a per-client sequence number and lets a model load a
checkpoint only as its first request (a resumed run gets a new model); a sampling session belongs to the
session that made it. So one process owns the session, the training client, the current sampler and the
base model's sampler, and the forwarder and the rollout servers call it: :class:`TinkerSession`, started by
:class:`~verl_remote_tinker.backend.TinkerBackend` as a :class:`~verl_remote.RayService`.

Futures are used as the API means them: ``submit_forward_backward`` returns once the request is queued,
``optim_step`` queues the step behind it, the sampler's save behind the step, and waits for the passes and the
step. The SDK numbers a training client's requests as they are made and the service runs them in that order, so a
call waits for an earlier one's answer only where it needs the answer: after the sampler's save has its place
in the order, the next step's requests go (they run after it), while samples wait for the new sampler itself.

In an overlapped run the next step's samples are drawn while a step trains, and the next step will ask for
their log-probs at the weights this step's update makes (its old log-probs). The session scores them ahead: a
response sampled from weights the queued optimizer steps have already moved past is scored as it arrives (those
arriving together in one forward pass, :data:`AHEAD_COALESCE_S`), one sampled earlier as the next optimizer step
is queued (one pass behind the step over all of them), and ``forward`` answers from those passes
(``actor/old_log_probs_ahead``: the share of a step's rows it found there). Only responses sampled at a
temperature above 0 are (verl's validation samples greedily); rows never sampled as a whole (a multi-turn
row) are scored when asked.

The actor counts the seconds the training calls wait on the service (``actor/service_wait_s``, per optimizer
step: the forward passes, the passes and the step itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from verl_remote import SamplingParams, is_transient, one_line, transient_status
from verl_remote_tinker import sdk
from verl_remote_tinker.credentials import api_key

__all__ = [
    "SDK_RANGE",
    "TinkerError",
    "TinkerSession",
    "WaitClock",
    "adam_params",
    "lost_model",
    "lr_schedule",
    "version_refused",
]

log = logging.getLogger(__name__)

#: Seconds destroy waits for each model to unload (the service may be gone: destroy must finish).
UNLOAD_TIMEOUT_S = 30.0

#: Seconds a sample request waits for others of the same prompt, to go to the service as one request.
COALESCE_S = 0.01
#: Seconds an overlapped run's sampled rows wait for others before they are scored ahead in one forward pass: a
#: step's groups, asked for together, come back within about 0.1 s of each other, and one pass a step keeps one
#: batch shape (SkyRL's server compiles each new one).
AHEAD_COALESCE_S = 0.25


class TinkerSession:
    """Owns the service's clients for one run; every method is a request or a few, awaited on the service."""

    def __init__(self, settings: dict[str, Any], base_model: str, optim: dict[str, Any]) -> None:
        self.settings = settings
        self.base_model = base_model
        self.optim = optim
        self.service: Any = None
        self.training: Any = None
        self.sampler: Any = None  # the policy's current weights
        self.base_sampler: Any = None  # the base model, for the reference log-probs
        self.model_ids: list[str] = []  # every model this run created, unloaded on close
        self.weights_version = 0  # optimizer steps applied so far in this session
        self.sampler_version = -1  # the weights' version of the last save started
        self.sampled_version = -1  # the weights' version of self.sampler
        self.saving: asyncio.Future[None] | None = None  # the sampler's save, when update_sampler did not wait
        self.placed: asyncio.Future[None] | None = None  # done once the save has its place in the request order
        self.pending: list[Any] = []  # forward_backward futures queued since the last optimizer step
        self.scores: dict[int, dict[tuple[int, ...], asyncio.Future[np.ndarray]]] = {}  # log-probs by version, row
        self.queued_version = 0  # the weights' version once every queued optimizer step has run
        self.sampled: list[tuple[int, ...]] = []  # overlapped: rows to score once the next step is queued
        self.arrived: list[tuple[int, ...]] = []  # overlapped: rows to score now, gathered for AHEAD_COALESCE_S
        self.scorer: asyncio.Future[None] | None = None
        self.asked: dict[int, int] = {}  # rows compute_log_prob asked for, by weights' version
        self.hits: dict[int, int] = {}  # of those, the rows scored ahead
        self.ahead = {"rows": 0, "used": 0}  # rows scored ahead, and of those the rows a step asked for
        self.ahead_rows: set[tuple[int, ...]] = set()  # the last rows scored ahead that no step asked for yet
        self.wait_s = 0.0
        self.clock = WaitClock()  # by phase of verl's step, for RemoteBackend.service_waits
        self.waiting: dict[Any, list[asyncio.Future[Any]]] = {}  # sample requests to send together
        self.flusher: asyncio.Future[None] | None = None
        self.sampling: set[asyncio.Future[None]] = set()
        self.answering: set[asyncio.Future[None]] = set()  # forward passes' answers under way
        self.schedule = lr_schedule(optim)
        self.schedule_steps = 0

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Connect, check the model is served, create the LoRA training client and both samplers."""
        key = api_key(self.settings)
        self.pauses = sdk.PauseReporter(str(self.settings["base_url"]), float(self.settings["timeout_s"]))
        self.pauses.install()
        self.service = await self._call(
            "connect",
            asyncio.to_thread(
                sdk.service_client,
                str(self.settings["base_url"]),
                key,
                float(self.settings["timeout_s"]),
                retries(self.settings),
            ),
        )
        capabilities = await self._call(
            "get_server_capabilities", sdk.capabilities(self.service, str(self.settings["base_url"]), key)
        )
        served = [m.model_name for m in capabilities.supported_models]
        if served and self.base_model not in served:
            raise ValueError(
                f"the service at {self.settings['base_url']} does not serve {self.base_model!r} "
                f"(remote_backend.base_model); it serves {served}"
            )
        self.training = await self._call(
            "create_model",
            sdk.created(
                self.service,
                "create_lora_training_client",
                base_model=self.base_model,
                rank=int(self.settings["lora_rank"]),
                seed=None if self.settings.get("lora_seed") is None else int(self.settings["lora_seed"]),
                train_mlp=bool(self.settings["train_mlp"]),
                train_attn=bool(self.settings["train_attn"]),
                train_unembed=bool(self.settings["train_unembed"]),
            ),
        )
        self.model_ids.append(str(self.training.model_id))
        self.pauses.watch(self.training, "training")
        self.base_sampler = await self._call(
            "create_sampling_session", sdk.created(self.service, "create_sampling_client", base_model=self.base_model)
        )
        self.pauses.watch(self.base_sampler, "sampling (base model)")
        await self.update_sampler(wait=True)
        return {"model_id": str(self.training.model_id)}

    async def close(self) -> list[str]:
        """Unload every model this run created; idempotent. Returns the models the service did not confirm
        unloading, each with its answer."""
        if self.service is None:
            return []
        if self.saving is not None and not self.saving.done():
            with contextlib.suppress(Exception):  # the service may be gone; destroy must still finish
                await asyncio.wait_for(asyncio.shield(self.saving), UNLOAD_TIMEOUT_S)
        left = []
        for model_id in list(self.model_ids):
            try:
                await self._unload(model_id)
            except Exception as exc:  # the service may be gone; destroy must still finish
                log.warning("verl-remote-tinker: could not unload model %s: %s", model_id, exc)
                left.append(f"model {model_id} ({' '.join(str(exc).split())})")
        self.model_ids = []
        try:
            await asyncio.wait_for(sdk.finish(self.service), UNLOAD_TIMEOUT_S)
        except Exception as exc:  # the service may be gone; destroy must still finish
            log.warning("verl-remote-tinker: could not end the session: %s", one_line(exc))
        self.service = None
        return left

    # -- log-probs ---------------------------------------------------------------------------------

    async def forward(self, rows: Sequence[Sequence[int]], *, update: bool = False) -> list[np.ndarray]:
        """The policy's log-prob of each next token (``len(row) - 1`` values per row), at the current weights.

        ``update``: asked by the actor update (its wait counts in ``service_wait_s``), not by ``compute_log_prob``.
        Rows scored at these weights before (ahead, or asked before) are answered from there.
        """
        keys = [tuple(int(t) for t in row) for row in rows]
        scores = self._scores(self.weights_version)
        asked = set(keys)
        if not update:
            version = self.weights_version
            self.asked[version] = self.asked.get(version, 0) + len(keys)
            self.hits[version] = self.hits.get(version, 0) + sum(1 for key in keys if key in self.ahead_rows)
        self.sampled = [row for row in self.sampled if row not in asked]
        self.arrived = [row for row in self.arrived if row not in asked]
        self.ahead["used"] += len(asked & self.ahead_rows)
        self.ahead_rows -= asked
        missing = [key for key in keys if key not in scores]  # a group's equal responses too: one shape a step
        if missing:
            await self._score(missing, scores)
        with self._waiting("update_actor" if update else "old_log_prob", timed=update):
            return list(await asyncio.gather(*(scores[key] for key in keys)))

    async def _score_ahead(self, rows: list[tuple[int, ...]]) -> None:
        """Score ``rows`` at the weights the queued requests make (an overlapped run's next step's rows)."""
        self.ahead["rows"] += len(set(rows))
        self.ahead_rows.update(rows)
        await self._score(rows, self._scores(self.queued_version))

    async def _score_arrived(self) -> None:
        expected = max(self.asked.values(), default=0)  # a step's rows, as the last steps asked for them
        waited = 0.0
        while waited < AHEAD_COALESCE_S and not (expected and len(self.arrived) >= expected):
            await asyncio.sleep(0.01)
            waited += 0.01
        rows, self.arrived, self.scorer = self.arrived, [], None
        if rows:
            with contextlib.suppress(Exception):  # the pass's failure goes to whoever asks for the rows
                await self._score_ahead(rows)

    def _sampled(self, rows: list[tuple[int, ...]], drawn: int) -> None:
        """Rows an overlapped run sampled from the weights of version ``drawn``: the step that trains them asks for
        their log-probs at the next version, so they are scored at once where that version is queued, else when
        the next optimizer step is."""
        if self.queued_version <= drawn:
            self.sampled += rows
            return
        self.arrived += rows
        if self.scorer is None:
            self.scorer = asyncio.ensure_future(self._score_arrived())

    def _scores(self, version: int) -> dict[tuple[int, ...], asyncio.Future[np.ndarray]]:
        """The log-probs at ``version`` (by row, each a future: its forward pass may be under way); older
        versions' are dropped."""
        for old in [v for v in self.scores if v < self.weights_version]:
            del self.scores[old]
        for old in [v for v in self.asked if v < self.weights_version - 2]:
            del self.asked[old]
            self.hits.pop(old, None)
        return self.scores.setdefault(version, {})

    async def _score(self, rows: list[tuple[int, ...]], scores: dict[tuple[int, ...], Any]) -> None:
        """Queue one forward pass over ``rows`` (its place in the request order taken before this returns) and put
        each row's future in ``scores``; a failed pass fails each future and leaves the rows unscored."""
        from tinker import types

        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints([int(t) for t in row[:-1]]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=[int(t) for t in row[1:]], dtype="int64"),
                    "weights": types.TensorData(data=[0.0] * (len(row) - 1), dtype="float32"),
                },
            )
            for row in rows
        ]
        loop = asyncio.get_running_loop()
        futures = {row: loop.create_future() for row in rows}  # a row sent twice (a group's equal responses) once
        for future in futures.values():
            future.add_done_callback(_retrieved)  # a pass scored ahead may fail with nobody asking
        scores.update(futures)

        def failed(exc: BaseException) -> None:
            for row, future in futures.items():
                if scores.get(row) is future:
                    del scores[row]
                if not future.done():
                    future.set_exception(exc)

        try:
            await self._placed()
            submitted = await self._call("forward", sdk.submitted(self.training, "forward", data, "cross_entropy"))
        except Exception as exc:
            failed(exc)
            raise

        async def answer() -> None:
            try:
                result = await self._call("forward", sdk.resolved(submitted))
                for row, out in zip(rows, result.loss_fn_outputs, strict=True):
                    if not futures[row].done():
                        futures[row].set_result(np.asarray(out["logprobs"].data, dtype=np.float32))
            except Exception as exc:
                failed(exc)
            finally:
                self.answering.discard(task)

        task = asyncio.ensure_future(answer())
        self.answering.add(task)

    async def reference(self, rows: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """The base model's log-prob of each next token, from a sampler of the base model (no LoRA)."""
        from tinker import types

        async def one(row: Sequence[int]) -> np.ndarray:
            values = await self._call(
                "compute_logprobs",
                sdk.requested(self.base_sampler, "compute_logprobs", types.ModelInput.from_ints(list(row))),
                phase="ref",
            )
            # Tinker answers one value per prompt token, the first None (nothing predicts it).
            values = list(values)[-(len(row) - 1) :]
            return np.asarray([0.0 if v is None else v for v in values], dtype=np.float32)

        return list(await asyncio.gather(*(one(row) for row in rows)))

    # -- training ----------------------------------------------------------------------------------

    async def submit_forward_backward(self, datums: list[dict[str, Any]]) -> None:
        """Queue one forward-backward pass (importance_sampling) and return without waiting for it."""
        from tinker import types

        data = [
            types.Datum(
                model_input=types.ModelInput.from_ints(d["input"]),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(data=d["target"], dtype="int64"),
                    "weights": types.TensorData(data=d["weights"], dtype="float32"),
                    "logprobs": types.TensorData(data=d["logprobs"], dtype="float32"),
                    "advantages": types.TensorData(data=d["advantages"], dtype="float32"),
                },
            )
            for d in datums
        ]
        await self._placed()  # after the sampler's save in the request order, which reads the weights as they are
        self.pending.append(
            await self._call(
                "forward_backward",
                sdk.submitted(self.training, "forward_backward", data, "importance_sampling"),
                phase="update_actor",
            )
        )

    async def optim_step(self) -> dict[str, float]:
        """Queue the optimizer step behind the passes and the sampler's save behind the step, wait for the passes
        and the step; the step's metrics."""
        from tinker import types

        lr = float(self.schedule.get_last_lr()[0])
        params = types.AdamParams(learning_rate=lr, **adam_params(self.optim))
        update = "update_actor"
        await self._placed()
        step = await self._call("optim_step", sdk.submitted(self.training, "optim_step", params), phase=update)
        self.queued_version += 1
        await self._saved()  # the last save (a step ago): one at a time
        self._save(self.queued_version)  # queued behind the step: the sampler of the weights it makes
        self.ahead_rows = set()  # rows scored ahead for the weights before that no step asked for: not used
        ahead, self.sampled = self.sampled, []
        if ahead:  # overlapped: the next step's rows, at the weights this step makes, queued behind it
            await self._score_ahead(ahead)
        pending, self.pending = self.pending, []
        with self._waiting(None, timed=True):  # the answers waited for together count once
            *_, result = await asyncio.gather(
                *(self._call("forward_backward", sdk.resolved(future), phase=update) for future in pending),
                self._call("optim_step", sdk.resolved(step), phase=update),
            )
        metrics = {"lr": lr}
        asked = self.asked.get(self.weights_version)
        if self.settings.get("overlap") and asked:  # logged as actor/old_log_probs_ahead
            metrics["old_log_probs_ahead"] = self.hits.get(self.weights_version, 0) / asked
        self.weights_version += 1
        for key, value in (result.metrics or {}).items():
            if key.endswith("grad_norm"):
                metrics["grad_norm"] = float(value)
        metrics.setdefault("grad_norm", float("nan"))  # the service reports none
        metrics["service_wait_s"], self.wait_s = self.wait_s, 0.0
        return metrics

    async def end_of_step(self) -> float:
        """Advance verl's learning-rate schedule by one training step; the next step's rate."""
        self.schedule.step()
        self.schedule_steps += 1
        return float(self.schedule.get_last_lr()[0])

    # -- sampling ----------------------------------------------------------------------------------

    async def update_sampler(self, wait: bool | None = None) -> None:
        """Save the current weights for sampling, unless the save is under way (``optim_step`` queues it behind
        each optimizer step); every sample that starts later uses them.

        In an overlapped run (``settings["overlap"]``, unless ``wait`` says) it returns once the save has its
        place in the request order: the trainer goes on with the next step, whose requests run after the save,
        while samples that start meanwhile wait for the new sampler. Its wait counts as the weight sync's.
        """
        if self.sampler_version != self.weights_version:
            await self._saved()  # one save at a time
            self._save(self.weights_version)
        if wait is None:
            wait = not self.settings.get("overlap")
        with self._waiting("update_weights", timed=False):
            await (self._saved() if wait else self._placed())

    def _save(self, version: int) -> None:
        """Start saving the weights of ``version`` (those the queued requests make) for the sampler."""
        self.sampler_version = version
        placed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.placed = placed
        self.saving = asyncio.ensure_future(self._save_for_sampler(placed, version))

    async def _save_for_sampler(self, placed: asyncio.Future[None], version: int) -> None:
        async def save() -> Any:
            try:
                sampler = await sdk.saving_for_sampling(self.training)
            finally:
                if not placed.done():
                    placed.set_result(None)
            return await sampler

        self.sampler = await self._call("save_weights_for_sampler", save())
        self.sampled_version = version
        self.pauses.watch(self.sampler, "sampling")

    async def _saved(self) -> None:
        """Wait for the sampler's save under way, if any; its failure is raised to every caller."""
        if self.saving is not None:
            await asyncio.shield(self.saving)

    async def _placed(self) -> None:
        """Wait until the sampler's save under way has its place in the training client's request order (a
        request made after that runs after the save), or has failed (raised here)."""
        if self.placed is not None and self.saving is not None:
            await asyncio.wait([self.placed, self.saving], return_when=asyncio.FIRST_COMPLETED)
            if self.saving.done() and not self.saving.cancelled() and self.saving.exception() is not None:
                await self._saved()

    async def sample(self, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
        """One response: its tokens, their log-probs and Tinker's stop reason ("stop" or "length").

        verl asks for ``rollout.n`` responses to a prompt as ``n`` requests sent together; requests for the same
        prompt and parameters that arrive within ``COALESCE_S`` go to the service as one ``sample`` with
        ``num_samples`` (independent samples, as the API means it): on SkyRL's server 64 samples in one request
        take 0.4 s, in 64 requests 6.5 s (docs/measurements.md).
        """
        key = (tuple(int(t) for t in prompt), params)
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(key, []).append(waiter)
        if self.flusher is None:
            self.flusher = asyncio.ensure_future(self._flush_samples())
        return await waiter

    async def sample_group(self, prompt: list[int], params: SamplingParams, n: int) -> list[dict[str, Any]]:
        """``n`` responses to one prompt as one ``sample`` with ``num_samples`` (a GRPO group, asked for at once by
        verl-remote's agent loop): each as :meth:`sample` answers."""
        waiters: list[asyncio.Future[dict[str, Any]]] = [asyncio.get_running_loop().create_future() for _ in range(n)]
        await self._sample_group(list(prompt), params, waiters)
        return [await waiter for waiter in waiters]

    async def _flush_samples(self) -> None:
        await asyncio.sleep(COALESCE_S)
        waiting, self.waiting, self.flusher = self.waiting, {}, None
        for (prompt, params), waiters in waiting.items():
            self.sampling.add(asyncio.ensure_future(self._sample_group(list(prompt), params, waiters)))

    async def _sample_group(
        self, prompt: list[int], params: SamplingParams, waiters: list[asyncio.Future[Any]]
    ) -> None:
        from tinker import types

        try:
            await self._saved()
            sampler, drawn = self.sampler, self.sampled_version
            # Tinker's SamplingParams: verl's temperature (0: greedy), top-p and top-k, and the stop ids (the
            # model's EOS and any the agent loop adds); a service may run on past one, and the replica cuts there.
            sampling = types.SamplingParams(
                max_tokens=params.max_tokens,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=params.top_k,
                stop=list(params.stop_token_ids),
            )
            response = await self._call(
                "sample",
                sdk.requested(sampler, "sample", types.ModelInput.from_ints(prompt), len(waiters), sampling),
                phase="gen",
            )
            if self.settings.get("overlap") and params.temperature > 0:
                self._sampled([tuple(prompt) + tuple(int(t) for t in s.tokens) for s in response.sequences], drawn)
            for waiter, sequence in zip(waiters, response.sequences, strict=True):
                waiter.set_result(
                    {
                        "tokens": [int(t) for t in sequence.tokens],
                        "logprobs": None if sequence.logprobs is None else [float(v) for v in sequence.logprobs],
                        "stop_reason": str(sequence.stop_reason),
                    }
                )
        except Exception as exc:
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(exc)
        finally:
            self.sampling.discard(asyncio.current_task())

    # -- checkpoints -------------------------------------------------------------------------------

    async def save(self, name: str) -> dict[str, Any]:
        """Save weights and optimizer state on the service; what a resume needs to find them."""
        result = await self._call(
            "save_state", sdk.requested(self.training, "save_state", name), phase="save_checkpoint"
        )
        return {
            "tinker_path": str(result.path),
            "model_id": str(self.training.model_id),
            "base_model": self.base_model,
            "schedule_steps": self.schedule_steps,
        }

    async def load(self, state: dict[str, Any]) -> None:
        """Continue from ``save``'s state: a new training client from the checkpoint, with its optimizer."""
        previous = self.training
        # 0.25's async variant awaits its REST client on the caller's loop, which is not the SDK's own
        # ("AsyncTinker client called from incorrect event loop"): the blocking one, in a thread.
        path = str(state["tinker_path"])
        self.training = await self._call(
            f"load_state {path}",
            sdk.resolved(await asyncio.to_thread(self.service.create_training_client_from_state_with_optimizer, path)),
        )
        self.model_ids.append(str(self.training.model_id))
        self.pauses.watch(self.training, "training")
        if previous is not None and str(previous.model_id) in self.model_ids:
            await self._unload(str(previous.model_id))
        self.schedule = lr_schedule(self.optim)
        for _ in range(int(state.get("schedule_steps", 0))):
            self.schedule.step()
        self.schedule_steps = int(state.get("schedule_steps", 0))
        self.weights_version += 1  # cached log-probs and the sampler are of the old weights
        self.queued_version = self.weights_version
        await self.update_sampler(wait=True)

    async def waits(self) -> dict[str, float]:
        """Seconds waited on the service since the last call, by phase (see :class:`WaitClock`)."""
        return self.clock.take()

    async def info(self) -> dict[str, Any]:
        return {
            "model_id": None if self.training is None else str(self.training.model_id),
            "models": list(self.model_ids),
            "weights_version": self.weights_version,
            "sampler_version": self.sampler_version,
            "scored_ahead": dict(self.ahead),
        }

    # -- plumbing ----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _waiting(self, phase: str | None, *, timed: bool) -> Iterator[None]:
        """A wait on the service: counted in ``phase``'s seconds (:class:`WaitClock`), and with ``timed`` (a
        training call's) in ``service_wait_s``."""
        start = time.perf_counter()
        if phase is not None:
            self.clock.begin(phase)
        try:
            yield
        finally:
            if phase is not None:
                self.clock.end(phase)
            if timed:
                self.wait_s += time.perf_counter() - start

    async def _unload(self, model_id: str) -> None:
        await self._call("unload_model", sdk.unload(self.service, model_id), timeout=UNLOAD_TIMEOUT_S)
        self.model_ids.remove(model_id)

    async def _call(
        self, what: str, awaitable: Any, *, timed: bool = False, timeout: float | None = None, phase: str | None = None
    ) -> Any:
        """Await one request to the service, at most ``remote_backend.timeout_s``; its failure as a TinkerError.

        ``timed``: a training call, whose wait counts towards ``service_wait_s``. The SDK retries a lost
        connection for up to five minutes on its own; the timeout bounds that too.
        """
        import tinker

        timeout = float(self.settings["timeout_s"]) if timeout is None else timeout
        try:
            with self._waiting(phase, timed=timed):
                return await asyncio.wait_for(awaitable, timeout)
        except asyncio.TimeoutError:
            raise TinkerError(
                f"Tinker call {what} ({self.settings['base_url']}): no answer within {timeout:g} s "
                "(remote_backend.timeout_s)",
                transient=True,
            ) from None
        except tinker.APIStatusError as exc:
            message = " ".join(str(exc.message).split())
            if exc.status_code in (400, 426) and "version" in message.lower():
                detail = exc.body.get("detail") if isinstance(exc.body, dict) else None
                said = message if not isinstance(detail, str) else " ".join(detail.split())
                raise TinkerError(version_refused(str(self.settings["base_url"]), exc.status_code, said)) from None
            raise TinkerError(
                f"Tinker call {what} ({self.settings['base_url']}): HTTP {exc.status_code}: {message}",
                transient=lost_model(message) or transient_status(exc.status_code),
            ) from None
        except (tinker.TinkerError, ValueError, OSError) as exc:  # the SDK reports failed futures as ValueError
            said = one_line(exc)
            code = re.search(r"Error code: (\d{3})\b", said)  # a failed future: the SDK's words for its answer
            raise TinkerError(
                f"Tinker call {what} ({self.settings['base_url']}): {said}",
                transient=lost_model(said) or (transient_status(int(code.group(1))) if code else is_transient(exc)),
            ) from None


#: The SDK versions this release is tested with, both ends (dists/verl-remote-tinker/pyproject.toml).
SDK_RANGE = ">=0.25,<0.39"


def version_refused(base_url: str, status: int, message: str) -> str:
    """One line for a service that refuses the installed SDK: which SDK, and how to get another."""
    return (
        f"the service at {base_url} refuses tinker SDK {sdk.version()} (HTTP {status}: {message}); install the "
        f"SDK it asks for, within verl-remote-tinker's range: pip install 'tinker{SDK_RANGE}' (the newest there), "
        "or, if the service needs a newer SDK than that range, a newer verl-remote-tinker"
    )


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class WaitClock:
    """Wall-clock seconds during which at least one request of a phase was outstanding: a step's 64 samples
    waited on together count once, as the time the step spent waiting for them."""

    def __init__(self) -> None:
        self.outstanding: dict[str, int] = {}
        self.since: dict[str, float] = {}
        self.seconds: dict[str, float] = {}

    def begin(self, phase: str) -> None:
        if not self.outstanding.get(phase):
            self.since[phase] = time.perf_counter()
        self.outstanding[phase] = self.outstanding.get(phase, 0) + 1

    def end(self, phase: str) -> None:
        self.outstanding[phase] -= 1
        if not self.outstanding[phase]:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - self.since.pop(phase)

    def take(self) -> dict[str, float]:
        """The seconds so far (a phase still waiting counts up to now), and start again from zero."""
        now = time.perf_counter()
        for phase, since in self.since.items():
            self.seconds[phase] = self.seconds.get(phase, 0.0) + now - since
            self.since[phase] = now
        taken, self.seconds = self.seconds, {}
        return taken


class TinkerError(RuntimeError):
    """A request to the service failed: the call, the service's address and its answer, on one line.

    ``transient``: whether another try may succeed (``verl-remote train`` then restarts the run from its last
    checkpoint, and a sampling request is retried; verl_remote.kit.faults): no answer within the timeout, a lost
    connection, an HTTP status of the moment (502, 503, 504, 429, 408), or a model the service no longer has
    (it restarted, or its stale-session cleanup unloaded it).
    """

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def lost_model(said: str) -> bool:
    """Whether the service's answer says it no longer has the run's model: SkyRL's ``Model <id> not loaded``
    (tests/tinker_service/test_tinker_server.py, a model unloaded behind the run's back), or ``not found``."""
    return re.search(r"\bModel \S+ not (loaded|found)\b", said) is not None


def retries(settings: dict[str, Any]) -> int:
    """How often the SDK's HTTP client may retry one request (429, 408, 409, 5xx, a lost connection): as often
    as fits in ``remote_backend.timeout_s`` at its longest backoff (10 s) unless ``remote_backend.max_retries``
    caps it, so that a rate limit is waited out and the timeout, not a count, ends the wait."""
    cap = settings.get("max_retries")
    fits = int(float(settings["timeout_s"]) // 10) + 3
    return fits if cap is None else min(int(cap), fits)


def adam_params(optim: dict[str, Any]) -> dict[str, float]:
    """verl's AdamW settings (``actor_rollout_ref.actor.optim``) as Tinker's ``AdamParams``, less the rate."""
    betas = list(optim.get("betas") or (0.9, 0.999))
    override = optim.get("override_optimizer_config") or {}
    return {
        "beta1": float(betas[0]),
        "beta2": float(betas[1]),
        "eps": float(override.get("eps", 1e-8)),  # torch.optim.AdamW's, which verl builds
        "weight_decay": float(optim.get("weight_decay", 0.0)),
        "grad_clip_norm": float(optim.get("clip_grad") or 0.0),
    }


def lr_schedule(optim: dict[str, Any]) -> Any:
    """verl's own learning-rate schedule (constant or cosine, with warmup) over a stand-in parameter."""
    import torch
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=float(optim["lr"]))
    optimizer.step()  # a no-op (no gradient), so that torch does not warn that the schedule steps first
    total = max(int(optim.get("total_training_steps", 1)), 1)
    warmup = int(optim.get("lr_warmup_steps", -1))
    if warmup <= 0:
        warmup = int(float(optim.get("lr_warmup_steps_ratio", 0.0)) * total)
    if optim.get("lr_scheduler_type", "constant") == "cosine":
        return get_cosine_schedule_with_warmup(
            optimizer,
            num_warmup_steps=warmup,
            num_training_steps=total,
            min_lr_ratio=float(optim.get("min_lr_ratio", 0.0)),
            num_cycles=float(optim.get("num_cycles", 0.5)),
            zero_indexed_step=bool(optim.get("zero_indexed_step", True)),
        )
    return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
