"""verl's agent loop for a run whose model work is a service's: each prompt's group of samples at the cost of the
group, not of each sample, in the TaskRunner's own process.

verl's V1 trainer hands each batch of prompts to an agent-loop manager (``actor_rollout_ref.rollout.agent.
agent_loop_manager_class``), which must put every trajectory into TransferQueue, with the prompt's status, as
verl's ``AgentLoopWorkerTQ`` does. verl's own manager runs a Ray actor that, for every sample, builds an agent
loop with Hydra, tokenizes the prompt, sends one request to the rollout server, sends the reward to a reward
worker (another Ray call and process) and puts the trajectory into TransferQueue: about 19 ms of CPU a sample on
2 cores, as much as the model's own work (docs/measurements.md, "The client's cost").

:class:`RemoteAgentLoopManager` is that manager for every run verl-remote makes (both launchers name it). Where
a batch is single-turn text with a rule-based reward (verl's ``single_turn_agent`` and no reward model, teacher,
trace or multi-modal processor), :class:`GroupSampler` serves it here: the prompt tokenized once for its group,
one ``generate_group`` call to the rollout server for its ``n`` samples, the reward computed in this process by
verl's own reward manager (the code verl's reward worker runs), and the trajectories put into TransferQueue a
few batches at a time. What each trajectory holds is what verl's ``SingleTurnAgentLoop`` and
``AgentLoopWorkerTQ._agent_loop_postprocess`` make of it, field for field (tests/test_agent_loop.py compares the
two). Any other batch (a multi-turn agent loop, a tool loop, a reward model) goes to verl's own agent-loop workers,
started the first time one is needed.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any
from uuid import uuid4

import numpy as np
import torch
import transfer_queue as tq
from omegaconf import DictConfig, open_dict
from tensordict import NonTensorData, NonTensorStack, TensorDict
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, _agent_loop_registry
from verl.protocol import DataProto
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopManagerTQ, apply_greedy_sampling_params
from verl.utils.model import compute_position_id_with_mask
from verl.utils.ray_utils import auto_await
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

__all__ = [
    "MANAGER",
    "SINGLE_TURN",
    "GroupSampler",
    "RemoteAgentLoopManager",
    "batched_path_problem",
    "reward_workers_deferred",
]

log = logging.getLogger(__name__)

#: verl's single-turn agent loop: its registry name and the class it names.
SINGLE_TURN = "single_turn_agent"
SINGLE_TURN_TARGET = "verl.experimental.agent_loop.single_turn_agent_loop.SingleTurnAgentLoop"
#: How long the run's end waits for the agent loop's requests in flight to be cancelled.
CLOSE_S = 5.0
#: This module's manager, as the run's config names it.
MANAGER = "verl_remote.integration.agent_loop.RemoteAgentLoopManager"
#: How long finished groups wait for others before they go into TransferQueue together (one put for many), unless
#: none is left sampling: a synchronous step needs them all anyway, and a put has a cost of its own.
FLUSH_S = 0.5


def batched_path_problem(config: DictConfig) -> str | None:
    """Why a run's batches cannot be served by :class:`GroupSampler` (each goes to verl's agent-loop workers then),
    or None when single-turn batches can: what verl's single-turn loop does beyond a text prompt, one generation and
    a rule-based reward."""
    rollout = config.actor_rollout_ref.rollout
    manager = rollout.agent.get("agent_loop_manager_class")
    if manager != MANAGER:
        return f"actor_rollout_ref.rollout.agent.agent_loop_manager_class={manager}"
    if str(rollout.agent.default_agent_loop) != SINGLE_TURN:
        return f"actor_rollout_ref.rollout.agent.default_agent_loop={rollout.agent.default_agent_loop}"
    if config.reward.reward_model.enable:
        return "a reward model (reward.reward_model.enable)"
    if config.get("distillation") is not None and config.distillation.get("enabled", False):
        return "distillation (a teacher model)"
    if rollout.trace.get("backend"):
        return f"rollout traces (actor_rollout_ref.rollout.trace.backend={rollout.trace.backend})"
    return None


@contextlib.contextmanager
def reward_workers_deferred(config: DictConfig) -> Iterator[None]:
    """While verl's trainer starts: no reward workers where verl-remote's agent loop scores the run's batches in its
    own process (:func:`batched_path_problem`); :meth:`RemoteAgentLoopManager.generate_sequences` makes the run's
    ``reward.num_workers`` the first time a batch goes to verl's agent-loop workers. A process less at the start."""
    if batched_path_problem(config) is not None:
        yield
        return
    wanted = config.reward.num_workers
    with open_dict(config):
        config.reward.num_workers = 0
    try:
        yield
    finally:
        with open_dict(config):
            config.reward.num_workers = wanted


@dataclass
class _Finished:
    """Trajectories ready for TransferQueue, and the prompts whose status they end, by partition."""

    keys: dict[str, list[str]] = field(default_factory=dict)
    fields: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    tags: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    statuses: dict[str, dict[str, str]] = field(default_factory=dict)

    def empty(self) -> bool:
        return not self.statuses


class GroupSampler:
    """verl's single-turn agent loop and its reward, a prompt's group at a time, on an event loop of its own thread.

    Built once per run from the run's config (the model's tokenizer, verl's Continuous Token builder, verl's reward
    manager), it serves :meth:`submit`'s batches without blocking the caller, as verl's manager does.
    """

    def __init__(self, config: DictConfig, llm_client: Any) -> None:
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker
        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

        self.config = config
        self.rollout = config.actor_rollout_ref.rollout
        self.llm_client = llm_client
        model = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        self.tokenizer = model.tokenizer
        if model.get("custom_chat_template", None) is not None:
            self.tokenizer.chat_template = model.custom_chat_template
        self.processor = model.processor
        self.mm_processor_kwargs = dict(config.data.get("mm_processor_kwargs", {}) or {})
        hf_model_type = getattr(model.hf_config, "model_type", None)
        self.builder = create_continuous_token_builder(
            self.tokenizer,
            hf_model_type=hf_model_type if isinstance(hf_model_type, str) else None,
            chat_template_kwargs=config.data.get("apply_chat_template_kwargs", {}),
            mm_processor_kwargs=self.mm_processor_kwargs,
            processor=self.processor,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="verl-remote-agent-loop", daemon=True)
        self.thread.start()

        async def reward_worker() -> Any:  # made on the thread's loop, which verl's reward manager keeps
            return RewardLoopWorker(config, reward_router_address=None)

        # The code verl's reward workers run, in this process: verl's reward manager and the run's reward function.
        self.reward = asyncio.run_coroutine_threadsafe(reward_worker(), self.loop).result()
        self.pending: set[Any] = set()
        self.finished = _Finished()
        self.flusher: asyncio.Task[None] | None = None
        self.inflight = 0  # groups submitted and not finished
        self.drained = asyncio.Event()  # set when the last of them finished
        #: Set each time trajectories or a prompt's status went into TransferQueue (the trainer waits on it).
        self.arrived = threading.Event()

    def takes(self, batch: TensorDict) -> bool:
        """Whether this batch is single-turn text (every prompt's agent loop verl's ``single_turn_agent``)."""
        if self.processor is not None:
            return False
        if _agent_loop_registry.get(SINGLE_TURN, {}).get("_target_") != SINGLE_TURN_TARGET:
            return False  # a config of the user's registers another class under the name
        if "agent_name" not in batch:
            return True
        names = batch["agent_name"]
        values = [names.data] if isinstance(names, NonTensorData) else list(names.tolist())
        return all(str(v) == SINGLE_TURN for v in values)

    def submit(self, batch: TensorDict) -> None:
        """Sample, score and store ``batch`` in the background (verl's manager returns before its trajectories are
        in TransferQueue, too)."""
        self._run(self._batch(batch))

    def _run(self, work: Coroutine[Any, Any, None]) -> None:
        future = asyncio.run_coroutine_threadsafe(work, self.loop)
        self.pending.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: Any) -> None:
        self.pending.discard(future)
        if not future.cancelled() and future.exception() is not None:
            exc = future.exception()
            log.error("verl-remote: the agent loop failed: %s", exc, exc_info=(type(exc), exc, exc.__traceback__))

    def close(self) -> None:
        """Stop the event loop's thread: what it still runs is cancelled and given a moment to end (the run is
        over), so that nothing is left pending when the interpreter exits."""

        async def cancel_the_rest() -> None:
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_S)

        if self.loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(timeout=CLOSE_S + 1)
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=CLOSE_S + 1)

    # -- a batch ---------------------------------------------------------------------------------------

    def _sampling_params(self, validate: bool) -> dict[str, Any]:
        rollout = self.rollout
        params = {
            "temperature": rollout.temperature,
            "top_p": rollout.top_p,
            "top_k": rollout.top_k,
            "repetition_penalty": 1.0,
            "logprobs": rollout.calculate_log_probs,
        }
        if validate:
            params.update(top_p=rollout.val_kwargs.top_p, top_k=rollout.val_kwargs.top_k)
            params["temperature"] = rollout.val_kwargs.temperature
        return params

    async def _batch(self, batch: TensorDict) -> None:
        validate = bool(batch["validate"]) if "validate" in batch else False
        batch.pop("validate", None)
        params = self._sampling_params(validate)
        rows = _rows(batch)
        partition = "val" if validate else "train"
        uids = [str(row["uid"]) for row in rows]
        self.inflight += len(rows)
        await asyncio.to_thread(
            tq.kv_batch_put, keys=uids, partition_id=partition, tags=[{"status": "running"}] * len(uids)
        )
        await asyncio.gather(*(self._group(row, params, validate, partition) for row in rows))

    async def _group(self, row: dict[str, Any], params: dict[str, Any], validate: bool, partition: str) -> None:
        uid = str(row["uid"])
        try:
            n = int(row.pop("__rollout_n__", self.rollout.n if not validate else self.rollout.val_kwargs.n))
            run_params = dict(params)
            if not validate and not row.pop("__do_sample__", True):
                apply_greedy_sampling_params(run_params)
            row.pop("agent_name", None)
            outputs = await self._sample(row, run_params, n)
            await self._score_group(outputs, row)
            # The prompt's columns, one object each for the group's trajectories (TransferQueue stores a value a
            # trajectory; wrapping each anew is most of what a put costs here).
            shared = {key: NonTensorData(value) for key, value in row.items() if not isinstance(value, torch.Tensor)}
            # and what every single-turn trajectory holds alike (the same values verl's loop gives each)
            shared.update(
                mm_processor_kwargs=NonTensorData(dict(self.mm_processor_kwargs)),
                mm_processor_output=NonTensorData(None),
                multi_modal_inputs=NonTensorData({}),
                num_turns=NonTensorData(2),
            )
            trajectories = [
                self._trajectory(output, {**row, "session_id": session}, shared)
                for session, output in enumerate(outputs)
            ]
            self._finish(partition, uid, "finished", trajectories)
        except Exception as exc:
            log.error("Error in _run_prompt for uid=%s", uid, exc_info=(type(exc), exc, exc.__traceback__))
            self._finish(partition, uid, "failure", [])

    async def _sample(self, row: dict[str, Any], params: dict[str, Any], n: int) -> list[AgentLoopOutput]:
        """verl's ``SingleTurnAgentLoop.run`` for ``n`` sessions of one prompt: the prompt built once, one call."""
        messages = list(row["raw_prompt"])
        prompt_ids = self._cap(self.builder.build_initial_tokens(messages))
        request_id = uuid4().hex
        server_id, server = await self.llm_client._acquire_server(request_id, prompt_ids=prompt_ids)
        began = time.perf_counter()
        try:
            answers = await server.generate_group.remote(prompt_ids=prompt_ids, sampling_params=params, n=n)
        finally:
            self.llm_client._release_server(server_id, request_id=request_id)
        took = time.perf_counter() - began
        length = int(self.rollout.response_length)
        outputs = []
        for answer in answers:
            extra = dict(answer["extra_fields"])
            extra.setdefault("min_global_steps", extra.get("global_steps"))
            extra.setdefault("max_global_steps", extra.get("global_steps"))
            log_probs = answer["log_probs"] or None
            merged = self.builder.merge_assistant_tokens(prompt_ids, answer["token_ids"])
            mask, response_log_probs = self.builder.align_response_metadata(
                merged, [], [] if log_probs else None, assistant_logprobs=log_probs
            )
            response_ids = merged.token_ids[-len(mask) :] if mask else []
            metrics = AgentLoopMetrics(generate_sequences=took, num_preempted=-1)
            output = AgentLoopOutput(
                prompt_ids=merged.token_ids[: len(merged.token_ids) - len(mask)],
                response_ids=response_ids[:length],
                response_mask=mask[:length],
                response_logprobs=response_log_probs[:length] if response_log_probs else None,
                routed_experts=None,
                multi_modal_data={},
                mm_processor_kwargs=dict(self.mm_processor_kwargs),
                mm_processor_output=None,
                num_turns=2,
                metrics=metrics,
                extra_fields=extra,
            )
            output.extra_fields.update({"turn_scores": [], "tool_rewards": []})
            outputs.append(output)
        return outputs

    def _cap(self, prompt_ids: list[int]) -> list[int]:
        length = int(self.rollout.prompt_length)
        if len(prompt_ids) > length:
            log.warning(
                "Prompt of %d tokens exceeds rollout.prompt_length=%d; left-truncating.", len(prompt_ids), length
            )
            return prompt_ids[-length:]
        return prompt_ids

    async def _score_group(self, outputs: list[AgentLoopOutput], row: dict[str, Any]) -> None:
        """Each trajectory's reward, as verl's reward worker computes it (``reward_score``, ``reward_extra_info``,
        and the time it took in ``metrics.compute_score``). With verl's default reward manager (``naive``), the whole
        group in one call to the thread pool, as its ``run_single`` computes each (:meth:`_naive_scores`); with any
        other, its ``run_single`` on each trajectory, as verl's reward worker calls it (:meth:`_score`)."""
        from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

        manager = self.reward.reward_manager
        if type(manager) is not NaiveRewardManager or self.config.reward.reward_model.enable:
            for session, output in enumerate(outputs):
                await self._score(output, {**row, "session_id": session})
            return
        began = time.perf_counter()
        results = await asyncio.to_thread(self._naive_scores, manager, outputs, row)
        if manager.is_async_reward_score:
            results = list(await asyncio.gather(*results))
        took = (time.perf_counter() - began) / max(1, len(outputs))
        for output, result in zip(outputs, results, strict=True):
            score, extra = _reward_result(result)
            output.reward_score = score
            output.extra_fields["reward_extra_info"] = extra
            output.metrics.compute_score = took

    def _naive_scores(self, manager: Any, outputs: list[AgentLoopOutput], row: dict[str, Any]) -> list[Any]:
        """verl's ``NaiveRewardManager.run_single`` on each trajectory of a group, its arguments as that method reads
        them from the reward worker's batch (numpy's scalars and copies, as they arrive over Ray); coroutines where
        the reward function is ``async``."""
        responses = [list(output.response_ids) for output in outputs]
        texts = self.tokenizer.batch_decode(responses, skip_special_tokens=True)
        data_source = np.array([row["data_source"]])[0]  # numpy's str, as the reward worker's batch holds it
        results = []
        for output, text in zip(outputs, texts, strict=True):
            # Copies of what the function may change, as the reward worker gets its own over Ray.
            extra_info = copy.deepcopy(row.get("extra_info", {}))
            extra_info.update(copy.deepcopy(output.extra_fields).items())
            extra_info["num_turns"] = np.array([output.num_turns])[0]
            extra_info["rollout_reward_scores"] = copy.deepcopy(row.get("reward_scores", {}))
            results.append(
                manager.compute_score(
                    data_source=data_source,
                    solution_str=text,
                    ground_truth=copy.deepcopy(row["reward_model"]["ground_truth"]),
                    extra_info=extra_info,
                )
            )
        return results

    async def _score(self, output: AgentLoopOutput, kwargs: dict[str, Any]) -> None:
        """verl's ``AgentLoopWorker._compute_score`` for one trajectory, by verl's reward code in this process."""
        began = time.perf_counter()
        prompts = torch.tensor(output.prompt_ids, dtype=torch.int64)
        responses = torch.tensor(output.response_ids, dtype=torch.int64)
        input_ids = torch.cat([prompts, responses], dim=0)
        attention_mask = torch.ones_like(input_ids, dtype=torch.int64)
        position_ids = compute_position_id_with_mask(attention_mask.unsqueeze(0)).squeeze(0)
        batch = TensorDict(
            {
                "prompts": prompts.unsqueeze(0),
                "responses": responses.unsqueeze(0),
                "attention_mask": attention_mask.unsqueeze(0),
                "input_ids": input_ids.unsqueeze(0),
                "position_ids": position_ids.unsqueeze(0),
            },
            batch_size=1,
        )
        # A copy, as verl's reward worker gets one over Ray: verl's reward managers write into extra_info.
        kwargs = copy.deepcopy(kwargs)
        non_tensor = {
            **{key: np.array([value]) for key, value in kwargs.items()},
            "__num_turns__": np.array([output.num_turns]),
            "tool_extra_fields": np.array([output.extra_fields], dtype=object),
            "prompt_len": np.array([len(output.prompt_ids)]),
            "response_len": np.array([len(output.response_ids)]),
        }
        result = await self.reward.compute_score(DataProto(batch=batch, non_tensor_batch=non_tensor))
        output.reward_score = result["reward_score"]
        output.extra_fields["reward_extra_info"] = result["reward_extra_info"]
        output.metrics.compute_score = time.perf_counter() - began

    def _trajectory(
        self, output: AgentLoopOutput, kwargs: dict[str, Any], shared: dict[str, Any]
    ) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """verl's ``AgentLoopWorkerTQ._agent_loop_postprocess`` of one single-turn trajectory: its key, fields, tag
        (``shared``: the prompt's non-tensor columns, wrapped once for the group)."""
        values = output.as_dict()
        values.update(kwargs)
        values.pop("multi_modal_data", None)
        input_ids = torch.cat([values["prompts"], values["responses"]], dim=0)
        values["loss_mask"] = values["response_mask"]
        values["input_ids"] = input_ids
        values["position_ids"] = torch.arange(len(input_ids), dtype=torch.int64)  # a mask of ones' position ids
        values["multi_modal_inputs"] = {}
        values.update(shared)
        prompt_len, response_len = values["prompts"].size(0), values["responses"].size(0)
        tag = {
            "status": "success",
            "prompt_len": prompt_len,
            "response_len": response_len,
            "seq_len": prompt_len + response_len,
            "global_steps": kwargs["global_steps"],
            "min_global_steps": values["extra_fields"].get("min_global_steps"),
            "max_global_steps": values["extra_fields"].get("max_global_steps"),
        }
        return f"{kwargs['uid']}_{kwargs['session_id']}_0", values, tag

    # -- into TransferQueue ----------------------------------------------------------------------------

    def _finish(self, partition: str, uid: str, status: str, trajectories: list[tuple[str, Any, Any]]) -> None:
        done = self.finished
        for key, values, tag in trajectories:
            done.keys.setdefault(partition, []).append(key)
            done.fields.setdefault(partition, []).append(values)
            done.tags.setdefault(partition, []).append(tag)
        done.statuses.setdefault(partition, {})[uid] = status
        self.inflight -= 1
        if self.flusher is None:
            self.flusher = asyncio.ensure_future(self._flush())
        if self.inflight == 0:
            self.drained.set()

    async def _flush(self) -> None:
        """Put what finished into TransferQueue once no group is sampling, or :data:`FLUSH_S` after the first
        finished: the trajectories first, then the status of their prompts (verl's replay buffer reads a prompt's
        trajectories once its status says it finished)."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.drained.wait(), FLUSH_S)
        self.drained.clear()
        done, self.finished, self.flusher = self.finished, _Finished(), None
        for partition, statuses in done.statuses.items():
            keys = done.keys.get(partition, [])
            if keys:
                await asyncio.to_thread(
                    tq.kv_batch_put,
                    keys=keys,
                    partition_id=partition,
                    fields=list_of_dict_to_tensordict(done.fields[partition]),
                    tags=done.tags[partition],
                )
            uids = list(statuses)
            await asyncio.to_thread(
                tq.kv_batch_put, keys=uids, partition_id=partition, tags=[{"status": statuses[u]} for u in uids]
            )
        self.arrived.set()


def _reward_result(result: Any) -> tuple[Any, dict[str, Any]]:
    """A reward function's answer as verl's naive reward manager reads it: a dict with ``score`` (all of it the
    extra info), or the score itself (its ``acc``)."""
    if isinstance(result, dict):
        return result["score"], dict(result)
    return result, {"acc": result}


def _rows(batch: TensorDict) -> list[dict[str, Any]]:
    """Each prompt of ``batch`` as verl's ``AgentLoopWorkerTQ.generate_sequences`` hands it to its agent loop."""
    rows = []
    for i in range(len(batch)):
        row: dict[str, Any] = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                row[key] = value[i]
            elif isinstance(value, NonTensorStack):
                row[key] = value[i].data
            elif isinstance(value, NonTensorData):
                row[key] = value.data
        rows.append(row)
    return rows


class RemoteAgentLoopManager(AgentLoopManagerTQ):
    """verl's V1 agent-loop manager, with single-turn batches served by :class:`GroupSampler` in this process and
    any other batch by verl's own agent-loop workers (started when one first needs them)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.agent_loop_workers: list[Any] = []
        self.reward_loop_worker_handles: list[Any] | None
        self.delegated = False  # a batch went to verl's agent-loop workers
        problem = batched_path_problem(self.config)
        self.sampler = GroupSampler(self.config, self.llm_client) if problem is None else None
        if problem is not None:
            log.info("verl-remote: every sample goes through verl's agent-loop workers: %s", problem)

    @classmethod
    @auto_await
    async def create(cls, *args: Any, **kwargs: Any) -> RemoteAgentLoopManager:
        instance = cls(*args, **kwargs)
        if instance.sampler is None:
            await instance._init_agent_loop_workers()
        return instance

    @property
    def arrivals(self) -> threading.Event | None:
        """Set each time samples went into TransferQueue, where this manager alone puts them (every batch so far
        single-turn); None once a batch went to verl's workers, which say nothing."""
        return self.sampler.arrived if self.sampler is not None and not self.delegated else None

    def generate_sequences(self, prompts: TensorDict) -> None:
        if self.sampler is not None and self.sampler.takes(prompts):
            self.sampler.submit(prompts)
            return
        self.delegated = True
        if not self.agent_loop_workers:
            if not self.reward_loop_worker_handles and not self.config.reward.reward_model.enable:
                self.reward_loop_worker_handles = _reward_workers(self.config)  # deferred (reward_workers_deferred)
            _run_now(self._init_agent_loop_workers())
        super().generate_sequences(prompts)

    def close(self) -> None:
        """Stop the sampler's thread (verl's workers end with the run's Ray)."""
        if self.sampler is not None:
            with contextlib.suppress(Exception):
                self.sampler.close()


def _reward_workers(config: DictConfig) -> list[Any]:
    """verl's reward workers (``reward.num_workers``, at least one), as verl's ``RewardLoopManager`` makes them."""
    import ray
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    made = ray.remote(RewardLoopWorker)
    return [
        made.options(name=f"reward_loop_worker_{i}_{uuid4().hex[:8]}").remote(config, None)
        for i in range(max(1, int(config.reward.num_workers)))
    ]


def _run_now(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` to its end from synchronous code (the trainer's thread, which runs no event loop)."""
    asyncio.run(work)
