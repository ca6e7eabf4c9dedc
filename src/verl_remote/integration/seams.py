"""Every name of verl's that verl-remote relies on, in one place: what it imports, subclasses, overrides, sets or
reads.

verl-remote patches nothing, but it subclasses verl's trainer, TaskRunner, worker and rollout replica, and a
subclass relies on private methods and attributes a verl release may rename. This table is the list of them,
with the parameters each is called or overridden with. It is checked both ways by ``tests/test_seams.py``: every
verl name the code imports, or overrides in a subclass of verl's, is on it (read from the code), and every entry
holds in the installed verl (:func:`problems`). :mod:`verl_remote.discovery.compat` refuses a verl outside the
tested range before any of them is touched; a verl in range whose V1 trainer is gone or disabled is named in one
line by ``verl-remote doctor`` and before a run starts (:func:`verl_problem`).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

__all__ = ["SEAMS", "Seam", "problems", "resolve", "verl_problem"]


@dataclass(frozen=True)
class Seam:
    #: ``module:Qualified.name``.
    target: str
    #: What verl-remote does with it.
    use: str
    #: The parameter names verl-remote relies on, in order (a method or function); None for an attribute.
    params: tuple[str, ...] | None = None
    #: For an attribute set on instances: the ``module:Qualified.function`` whose source sets it.
    set_in: str | None = None


_TRAINER = "verl.trainer.ppo.v1.trainer_base:PPOTrainer"
_REPLICA = "verl.workers.rollout.replica:RolloutReplica"
_SYNC = "verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync"
_AGENT_TQ = "verl.trainer.ppo.v1.agent_loop_tq"
_AGENT_LOOP = "verl.experimental.agent_loop.agent_loop"

SEAMS: tuple[Seam, ...] = (
    # The trainer (integration/trainer.py): RemotePPOTrainer subclasses PPOTrainerSync.
    Seam(f"{_TRAINER}._init_resource_pool_mgr", "forwarder worker classes and CPU-only pools", ("self",)),
    Seam(f"{_TRAINER}._build_replay_buffer", "checks for a step's samples every 50 ms, not 2 s", ("self",)),
    Seam(
        f"{_TRAINER}._add_prompts_to_generate",
        "the replay buffer's refill (its refill_fn) of evicted groups: a failed request stops the run first",
        ("self", "num_prompts"),
    ),
    Seam(f"{_TRAINER}._save_checkpoint", "a completion record after verl's save", ("self",)),
    Seam(f"{_TRAINER}._load_checkpoint", "resumes from the newest complete checkpoint", ("self",)),
    Seam(
        f"{_TRAINER}._step_once",
        "the sampler's own error when a step's requests failed",
        ("self", "metrics", "timing_raw", "sample_batch_size"),
    ),
    Seam(f"{_TRAINER}._validate", "the sampler's own error during validation", ("self",)),
    Seam(
        f"{_TRAINER}._compute_metrics",
        "each step's mean reward for the run summary",
        ("self", "batch", "metrics", "timing_raw", "global_steps", "epoch"),
    ),
    Seam(
        f"{_TRAINER}._add_async_warmup_batches",
        "remote_async: the batches sampled ahead, as verl's async trainers add them",
        ("self", "num_warmup_batches"),
    ),
    Seam(f"{_TRAINER}._stop_rollout_profiling", "remote_async: a profiled step's rollout profile ends", ("self",)),
    Seam(f"{_TRAINER}.curr_step_profile", "remote_async: whether the step is profiled", set_in=f"{_TRAINER}.fit"),
    Seam(
        "verl.trainer.ppo.v1.replay_buffer:ReplayBufferAsync",
        "remote_async: verl's async replay buffer, chosen by verl for any mode name but sync",
    ),
    Seam(f"{_TRAINER}.prepare_step", "inherited unchanged: verl's step preparation runs as in verl", ("self",)),
    Seam(f"{_TRAINER}._start_profiling", "inherited: profiles reach the forwarders' start_profile", ("self",)),
    Seam(f"{_TRAINER}._stop_profiling", "inherited: the forwarders' stop_profile(run_command=...)", ("self",)),
    Seam(
        f"{_TRAINER}.llm_server_manager",
        "each replica's servers learn the weights version",
        set_in=f"{_TRAINER}._setup",
    ),
    Seam(f"{_TRAINER}.get_llm_client", "the client verl's agent loop samples through (OneServerClient)", ("self",)),
    Seam(
        "verl.workers.rollout.llm_server:LLMServerManager.get_client",
        "OneServerClient with the run's servers",
        ("self", "client_cls"),
    ),
    Seam(
        "verl.workers.rollout.llm_server:LLMServerManager.server_handles",
        "the servers OneServerClient routes to",
        set_in="verl.workers.rollout.llm_server:LLMServerManager._initialize_llm_servers",
    ),
    Seam(
        "verl.workers.rollout.llm_server:LLMServerManager.server_addresses",
        "the servers' ids, as verl's balancer keys them",
        set_in="verl.workers.rollout.llm_server:LLMServerManager._initialize_llm_servers",
    ),
    Seam(
        "verl.workers.rollout.router:GlobalRequestLoadBalancer",
        "RunBalancer hands every call to it once a run has more than one rollout server",
        ("servers",),
    ),
    # The client (integration/client.py): OneServerClient subclasses verl's.
    Seam("verl.workers.rollout.llm_server:LLMServerClient", "OneServerClient's base"),
    Seam(
        "verl.workers.rollout.llm_server:LLMServerClient.__init__",
        "the config and the balancer's handle",
        ("self", "config", "load_balancer_handle"),
    ),
    Seam(
        "verl.workers.rollout.llm_server:LLMServerClient._acquire_server",
        "the one server, without the balancer's call",
        ("self", "request_id"),
    ),
    Seam(
        "verl.workers.rollout.llm_server:LLMServerClient._release_server",
        "no call to the balancer when it was not asked",
        ("self", "server_id", "request_id"),
    ),
    Seam(f"{_TRAINER}.role_worker_mapping", "the forwarder per role", set_in=f"{_TRAINER}._init_resource_pool_mgr"),
    Seam(f"{_TRAINER}.resource_pool_manager", "its pool spec", set_in=f"{_TRAINER}._init_resource_pool_mgr"),
    Seam(f"{_TRAINER}.mapping", "roles to pools", set_in=f"{_TRAINER}._init_resource_pool_mgr"),
    Seam("verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_init_end", "weights version after the sync", ("self",)),
    Seam("verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_step_end", "no sync after a stop", ("self",)),
    Seam("verl.trainer.ppo.v1.trainer_sync:PPOTrainerSync.on_sample_end", "failed requests stop a step", ("self",)),
    Seam("verl.trainer.ppo.v1.trainer_base:TRAINER_REGISTRY", "a dict that imports the trainer on first lookup"),
    Seam(
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.poll_interval",
        "see _build_replay_buffer",
        set_in="verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__",
    ),
    # The TaskRunner: RemoteTaskRunner subclasses the Ray actor's class.
    Seam("verl.trainer.main_ppo:TaskRunnerV1.__ray_actor_class__", "RemoteTaskRunner's base"),
    Seam(
        "verl.trainer.main_ppo:TaskRunnerV1.__ray_actor_class__.run",
        "the run, then the summary; it builds the trainer in the calling thread (LAUNCHER)",
        ("self", "config"),
    ),
    Seam(
        "verl.single_controller.ray.base:ResourcePoolManager.create_resource_pool",
        "CPU-only bundles",
        ("self",),
    ),
    Seam(
        "verl.single_controller.ray.base:RayResourcePool.__init__",
        "a pool without GPUs",
        ("self", "process_on_nodes", "use_gpu", "name_prefix", "max_colocate_count"),
    ),
    # The forwarder (integration/worker.py).
    Seam(
        "verl.single_controller.base:Worker._register_dispatch_collect_info",
        "every forwarder answers the actor, ref and rollout meshes",
        ("self", "mesh_name", "dp_rank", "is_collect"),
    ),
    Seam("verl.utils.flops_counter:ESTIMATE_FUNC", "MFU from the backend's device, per model type"),
    Seam("verl.utils.flops_counter:get_device_flops", "the backend's device's peak", ("unit", "device_name")),
    # The rollout replica (integration/rollout.py).
    Seam(
        f"{_REPLICA}.__init__",
        "the replica's config, model config, rank and name suffix",
        (
            "self",
            "replica_rank",
            "config",
            "model_config",
            "gpus_per_node",
            "is_reward_model",
            "is_teacher_model",
            "name_suffix",
        ),
    ),
    Seam(f"{_REPLICA}.launch_servers", "one CPU-only server actor", ("self",)),
    Seam(f"{_REPLICA}.init_standalone", "no GPUs to take", ("self",)),
    Seam(f"{_REPLICA}.init_colocated", "no GPUs to share", ("self", "resource_pool")),
    Seam(f"{_REPLICA}.rollout_worker_use_gpu", "False", ("self",)),
    Seam(f"{_REPLICA}._server_handle", "the server verl's clients call", set_in=f"{_REPLICA}.__init__"),
    Seam(f"{_REPLICA}._server_address", "the server's name in verl's logs", set_in=f"{_REPLICA}.__init__"),
    Seam(f"{_REPLICA}.rollout_mode", "standalone or colocated", set_in=f"{_REPLICA}.__init__"),
    Seam(f"{_REPLICA}.servers", "the server actors", set_in=f"{_REPLICA}.__init__"),
    Seam(f"{_REPLICA}.name_suffix", "the server's name", set_in=f"{_REPLICA}.__init__"),
    Seam(f"{_REPLICA}.max_concurrency", "the server actor's concurrency, as verl sizes it"),
    # The driver's checks (cli/run.py): verl's own, before Ray starts.
    Seam("verl.utils.config:validate_config", "verl's config checks", ("config", "use_reference_policy", "use_critic")),
    Seam("verl.trainer.ppo.utils:need_critic", "verl's config checks", ("config",)),
    Seam("verl.trainer.ppo.utils:need_reference_policy", "verl's config checks", ("config",)),
    Seam("verl.trainer.constants_ppo:get_ppo_ray_runtime_env", "verl's runtime environment for Ray", ("config",)),
    # The trainer's classes and what RemotePPOTrainer overrides beyond the steps above (integration/trainer.py).
    Seam(f"{_SYNC}", "RemotePPOTrainer's base"),
    Seam(f"{_SYNC}.__init__", "the trainer built from the run's config", ("self", "config")),
    Seam(f"{_SYNC}.init", "the backend built before verl's workers", ("self",)),
    Seam(f"{_SYNC}.fit", "the backend destroyed on every way out", ("self", "agent_loop_manager")),
    Seam(f"{_SYNC}.on_train_begin", "the weights version before the first step", ("self",)),
    Seam(f"{_SYNC}._consume_sync_metrics", "the background weight sync's timings", ("self",)),
    Seam(f"{_SYNC}._update_actor", "waits for a background weight sync", ("self", "batch", "metrics")),
    Seam(
        f"{_SYNC}._compute_old_log_prob",
        "the sampler's log-probs as the old ones where the run's checks found them the trainer's",
        ("self", "batch", "metrics"),
    ),
    Seam("verl.trainer.ppo.v1.trainer_base:register_trainer", "the remote and remote_async modes", ("name",)),
    Seam("verl.trainer.ppo.utils:Role", "the roles the forwarder takes"),
    Seam("verl.single_controller.ray.base:ResourcePoolManager", "CPUResourcePoolManager's base"),
    Seam("verl.single_controller.ray.base:RayResourcePool", "a pool without GPUs"),
    Seam("verl.trainer.main_ppo:TaskRunnerV1", "the Ray actor verl's launcher runs; RemoteTaskRunner's base"),
    # The forwarder (integration/worker.py): verl's worker-group API.
    Seam("verl.single_controller.base:Worker", "RemoteForwarderWorker's base"),
    Seam("verl.single_controller.base:Worker.__init__", "the forwarder's rank and world", ("self",)),
    Seam(
        "verl.single_controller.base.decorator:register",
        "the forwarder's methods as verl's worker group calls them",
        ("dispatch_mode", "execute_mode", "blocking"),
    ),
    Seam("verl.single_controller.base.decorator:Dispatch", "ONE_TO_ALL for lifecycle calls"),
    Seam(
        "verl.single_controller.base.decorator:make_nd_compute_dataproto_dispatch_fn",
        "the actor and ref meshes' compute calls",
        ("mesh_name",),
    ),
    Seam("verl.utils.flops_counter:FlopsCounter", "MFU per model type", ("config",)),
    Seam("verl.utils.tensordict_utils:get", "a batch's fields", ("tensordict", "key", "default")),
    Seam("verl.utils.tensordict_utils:get_tensordict", "the forwarder's answers", ("tensor_dict", "non_tensor_dict")),
    Seam(
        "verl.utils.tensordict_utils:make_iterator",
        "verl's mini-batches (size, epochs, shuffle and seed as verl sends them)",
        ("tensordict", "mini_batch_size", "epochs", "seed", "dataloader_kwargs"),
    ),
    Seam("verl.utils.tensordict_utils:assign_non_tensor", "the loss's settings on a mini-batch", ("tensor_dict",)),
    # The rollout replica (integration/rollout.py).
    Seam(f"{_REPLICA}", "RemoteRolloutReplica's base"),
    Seam("verl.workers.rollout.replica:RolloutMode", "standalone or colocated"),
    Seam("verl.workers.rollout.replica:TokenOutput", "a sample's tokens, log-probs and weights version"),
    # What backends compute with (kit/compute.py, the local engine, verl-remote-tinker's session).
    Seam("verl.workers.utils.losses:ppo_loss", "every backend's policy loss", ("config", "model_output", "data")),
    Seam("verl.utils.metric:Metric", "the loss's metrics"),
    Seam(
        "verl.trainer.ppo.core_algos:POLICY_LOSS_REGISTRY",
        "the policy losses the gradient check compares (verl-remote check --losses), and a run's loss mode checked",
    ),
    Seam("verl.trainer.ppo.core_algos:ADV_ESTIMATOR_REGISTRY", "a run's advantage estimator checked"),
    Seam("verl.trainer.ppo.core_algos:AdvantageEstimator", "a run's advantage estimator checked"),
    Seam("verl.utils.config:omega_conf_to_dataclass", "verl's actor config as its dataclass", ("config",)),
    Seam("verl.workers.config.optimizer:build_optimizer", "the local engine's optimizer", ("parameters", "config")),
    Seam(
        "verl.utils.torch_functional:get_constant_schedule_with_warmup",
        "the learning-rate schedule",
        ("optimizer", "num_warmup_steps"),
    ),
    Seam(
        "verl.utils.torch_functional:get_cosine_schedule_with_warmup",
        "the learning-rate schedule",
        (
            "optimizer",
            "num_warmup_steps",
            "num_training_steps",
            "min_lr_ratio",
            "num_cycles",
            "last_epoch",
            "init_lr_ratio",
            "zero_indexed_step",
        ),
    ),
    Seam(
        f"{_TRAINER}._balance_batch",
        "one forwarder: verl's batch and metrics without its partitioning",
        ("self", "batch", "metrics", "logging_prefix", "keep_minibatch"),
    ),
    Seam(f"{_TRAINER}._get_required_batch_multiple", "the batch's multiple for one forwarder", ("self", "dp_size")),
    Seam(
        "verl.trainer.ppo.padding_utils:upsample_batch_to_divisible_size",
        "verl's padding of a batch to that multiple",
        ("batch", "batch_multiple", "eos_token_id"),
    ),
    Seam(
        "verl.utils.seqlen_balancing:log_seqlen_unbalance",
        "verl's global_seqlen metrics",
        ("seqlen_list", "partitions", "prefix"),
    ),
    Seam(
        "verl.utils.seqlen_balancing:get_seqlen_balanced_partitions",
        "one partition, in order, for one rank (tests/test_light_client.py)",
        ("seqlen_list", "k_partitions", "equal_size"),
    ),
    Seam(
        "verl.utils.transferqueue_utils:kv_batch_meta2batch_meta",
        "TransferQueue's field schema: which fields a forwarder fetches (forwarder_view.py)",
        ("meta",),
    ),
    Seam("verl.trainer.ppo.v1.replay_buffer:ReplayBuffer", "verl's replay buffer, synchronous"),
    Seam("verl.trainer.ppo.v1.replay_buffer:ReplayBufferAsync", "verl's replay buffer, overlapped"),
    Seam(
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer._wait_for_next_poll",
        "its wait between looks at TransferQueue, ended when verl-remote's agent loop put samples there",
        ("self", "partition_id", "last_debug_time"),
    ),
    Seam(
        "verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.poll_interval",
        "its seconds between looks",
        set_in=("verl.trainer.ppo.v1.replay_buffer:ReplayBuffer.__init__"),
    ),
    # The agent loop (integration/agent_loop.py): verl's V1 agent-loop manager, and what its single-turn loop and
    # reward worker do, a prompt's group at a time in the TaskRunner's process.
    Seam(f"{_AGENT_TQ}:AgentLoopManagerTQ", "RemoteAgentLoopManager's base: verl's workers for other agent loops"),
    Seam(f"{_AGENT_TQ}:AgentLoopManagerTQ.__init__", "the run's config, client and reward workers", ("self",)),
    Seam(f"{_AGENT_TQ}:AgentLoopManagerTQ.create", "the manager verl's TaskRunner makes (auto_await'ed)"),
    Seam(f"{_AGENT_TQ}:AgentLoopManagerTQ.generate_sequences", "a batch of prompts", ("self", "prompts")),
    Seam(f"{_AGENT_TQ}:apply_greedy_sampling_params", "__do_sample__ false", ("params",)),
    Seam(f"{_AGENT_LOOP}:AgentLoopOutput", "each trajectory, as verl's single-turn loop makes it"),
    Seam(f"{_AGENT_LOOP}:AgentLoopMetrics", "its timings", ("generate_sequences", "tool_calls", "compute_score")),
    Seam(f"{_AGENT_LOOP}:_agent_loop_registry", "single_turn_agent still verl's own class"),
    Seam(
        "verl.experimental.reward_loop.reward_loop:RewardLoopWorker",
        "verl's reward worker's code, in the TaskRunner's process",
        ("config", "reward_router_address"),
    ),
    Seam("verl.experimental.reward_loop.reward_loop:RewardLoopWorker.compute_score", "one reward", ("self", "data")),
    Seam(
        "verl.experimental.reward_loop.reward_manager.naive:NaiveRewardManager",
        "verl's default reward manager: its run_single's arguments, for a group at once",
        ("config", "tokenizer", "compute_score"),
    ),
    Seam("verl.protocol:DataProto", "the batch a reward manager's run_single reads"),
    Seam("verl.utils.model:compute_position_id_with_mask", "a trajectory's position ids", ("mask",)),
    Seam("verl.utils.ray_utils:auto_await", "create, awaited or not"),
    Seam(
        "verl.utils.tensordict_utils:list_of_dict_to_tensordict",
        "the trajectories as verl's worker puts them",
        ("list_of_dicts",),
    ),
    Seam(
        "verl.utils.tokenizer.continuous_token_wiring:create_continuous_token_builder",
        "verl's prompt tokens and the merge of a response",
        ("tokenizer",),
    ),
    # Read, not imported (integration/rewards.py): the data sources verl's built-in rewards score.
    Seam(
        "verl.utils.reward_score:default_compute_score",
        "its source read for the data sources it scores",
        ("data_source", "solution_str", "ground_truth", "extra_info"),
    ),
)


#: What verl's trainer entry point says when a release has switched the V1 trainer off (verl's ``neo`` branch,
#: towards RFC #6988).
V1_DISABLED = "TrainerV1 is disabled"


def resolve(target: str) -> Any:
    """The object a ``module:Qualified.name`` target names (imports the module)."""
    module, _, path = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, path.split(".")):
        obj = getattr(obj, part)
    return obj


def problems(seams: tuple[Seam, ...] = SEAMS) -> list[str]:
    """Each entry the installed verl does not hold, as ``target: what is wrong`` (imports verl's modules)."""
    found = []
    for seam in seams:
        name = seam.target.rpartition(".")[2]
        try:
            if seam.set_in is not None:
                source = inspect.getsource(resolve(seam.set_in))
                if f"self.{name} =" not in source and f"self.{name}:" not in source:
                    found.append(f"{seam.target}: not set in {seam.set_in}")
                continue
            obj = resolve(seam.target)
            if seam.params is not None:
                params = [p for p in inspect.signature(obj).parameters if p != "_ray_trace_ctx"]
                if params[: len(seam.params)] != list(seam.params):
                    found.append(f"{seam.target}: parameters {params}, verl-remote relies on {list(seam.params)}")
        except (ImportError, AttributeError, TypeError, OSError, ValueError) as exc:
            found.append(f"{seam.target}: {type(exc).__name__}: {exc}")
    return found


#: Where verl's V1 trainer lives: the seams a run's driver checks before it starts (the driver imports these
#: modules anyway); ``verl-remote doctor`` checks them all.
V1_MODULES = ("verl.trainer.", "verl.single_controller.ray.")


def verl_problem(everything: bool = True) -> str | None:
    """One line when the installed verl lacks what verl-remote relies on (its V1 trainer switched off or gone), or
    None when it has it. ``everything=False`` checks the V1 trainer's seams only (:data:`V1_MODULES`)."""
    from importlib.metadata import version

    installed = version("verl")
    try:
        entry = inspect.getsource(importlib.import_module("verl.trainer.main_ppo"))
    except (ImportError, OSError) as exc:
        entry, missing = "", [f"verl.trainer.main_ppo: {type(exc).__name__}: {exc}"]
    else:
        chosen = tuple(seam for seam in SEAMS if everything or seam.target.startswith(V1_MODULES))
        missing = problems(chosen)
    if V1_DISABLED in entry:
        return (
            f"verl {installed} has its V1 trainer switched off (verl.trainer.main_ppo says {V1_DISABLED!r}), and "
            "verl-remote runs verl's V1 trainer: install a verl release that has it (pip install 'verl>=0.9.1,<0.10')"
        )
    if not missing:
        return None
    more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
    return (
        f"verl {installed} lacks what verl-remote relies on (its V1 trainer, trainer.use_v1=true): {missing[0]}{more}; "
        "install a verl release that has it (pip install 'verl>=0.9.1,<0.10'); verl-remote doctor lists every one"
    )
