"""Every name of verl's that verl-remote relies on beyond verl's documented extension points, in one place.

verl-remote patches nothing, but it subclasses verl's trainer, TaskRunner, worker and rollout replica, and a
subclass relies on private methods and attributes a verl release may rename. This table is the list of them,
with the parameters each is called or overridden with; ``tests/test_verl_plugin.py`` checks every entry
against the installed verl, so a verl upgrade that moves one fails that test, naming it, rather than a run.
:mod:`verl_remote.discovery.compat` refuses a verl outside the tested range before any of them is touched.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SEAMS", "Seam"]


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

SEAMS: tuple[Seam, ...] = (
    # The trainer (integration/trainer.py): RemotePPOTrainer subclasses PPOTrainerSync.
    Seam(f"{_TRAINER}._init_resource_pool_mgr", "forwarder worker classes and CPU-only pools", ("self",)),
    Seam(f"{_TRAINER}._build_replay_buffer", "checks for a step's samples every 50 ms, not 2 s", ("self",)),
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
    Seam("verl.trainer.main_ppo:TaskRunnerV1.run", "the run, then the summary", ("config",)),
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
)
