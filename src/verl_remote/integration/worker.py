"""The forwarder worker: verl's actor/rollout/ref worker-group surface on a CPU.

verl's V1 trainer drives a worker group through a handful of methods with
unwritten contracts (which dispatch meshes exist, what ``compute_log_prob``
returns and in which layout, which metrics ``update_actor`` must report, that
``update_weights`` is non-blocking). :class:`RemoteForwarderWorker` carries all
of that once. A backend's worker subclasses it and maps four calls to its
service: :meth:`~RemoteForwarderWorker.backend_log_probs`,
:meth:`~RemoteForwarderWorker.backend_forward_backward`,
:meth:`~RemoteForwarderWorker.backend_optimizer_step` and, optionally,
:meth:`~RemoteForwarderWorker.backend_end_of_step`.

Lifecycle calls (weight sync, checkpoints) go to the :class:`~verl_remote.RemoteBackend`
contract, from rank 0 only, so that more than one forwarder never syncs or
saves twice.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

from omegaconf import DictConfig
from tensordict import TensorDict
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu

from verl_remote.discovery.registry import load_backend_class
from verl_remote.integration.handoff import read as read_handoff
from verl_remote.kit.backend import RemoteBackend
from verl_remote.kit.overrides import check_overrides

__all__ = ["RemoteForwarderWorker"]

log = logging.getLogger(__name__)


#: In ``backend_forward_backward``'s ``meta``: True when the mini-batch's ``old_log_probs`` are the log-probs of the
#: model as it is now (the step's first mini-batch, before any optimizer step, where the trainer computed them at
#: these weights or found the sampler's the same), so a service need not score the tokens again for them.
OLD_LOG_PROBS_CURRENT = "old_log_probs_current"

#: The methods a backend's worker implements or may override, called by verl-remote with these bases' arguments.
HOOKS = (
    "backend_log_probs",
    "backend_forward_backward",
    "backend_optimizer_step",
    "backend_end_of_step",
    "backend_start_profile",
    "backend_stop_profile",
    "backend_device_name",
    "backend_flops",
)


class RemoteForwarderWorker(Worker):
    """Base class of a backend's forwarder worker (one Ray process, no GPU)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_overrides(cls, RemoteForwarderWorker, HOOKS)  # a hook that does not fit fails here, not in a step

    def __init__(self, config: DictConfig, role: str, distillation_config: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.config = config
        self.role = role
        handoff = read_handoff(config.rollout)
        self.backend_name = handoff.backend
        self.backend: RemoteBackend = load_backend_class(handoff.backend).from_config(
            handoff.main_config(config), handle=handoff.handle
        )
        self._flops = _flops_counter(str(config.model.path))
        self._profile_noted = False

    # -- verl's worker-group surface -------------------------------------------------------

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        # One forwarder per dp rank; every rank returns its share of the results.
        for mesh in ("actor", "ref", "rollout"):
            self._register_dispatch_collect_info(mesh, dp_rank=self.rank, is_collect=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: TensorDict) -> TensorDict:
        return self._log_probs(data, reference=False)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="ref"))
    def compute_ref_log_prob(self, data: TensorDict) -> TensorDict:
        return self._log_probs(data, reference=True)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: TensorDict) -> TensorDict:
        start = time.perf_counter()
        mini_batch_size = int(tu.get(data, "mini_batch_size"))
        epochs = int(tu.get(data, "epochs", 1))
        seed = tu.get(data, "seed")
        dataloader_kwargs = tu.get(data, "dataloader_kwargs") or {}
        meta = {
            "temperature": float(tu.get(data, "temperature", 1.0)),
            "calculate_entropy": bool(tu.get(data, "calculate_entropy", False)),
            "dp_size": self.world_size,
        }
        # Whether old_log_probs are the log-probs of the weights this update starts from (the trainer says so:
        # verl's pass at this step, or the sampler's found the same), until the first optimizer step.
        current = bool(tu.get(data, OLD_LOG_PROBS_CURRENT, False))
        tensors = data.select(*[k for k, v in data.items() if _is_tensor(v)])
        per_rank = max(mini_batch_size // self.world_size, 1)
        metrics: dict[str, list[float]] = {}
        for mini_batch in _mini_batches(tensors, per_rank, epochs, seed, dataloader_kwargs):
            # verl's loss normalises by the global mini-batch, as its own workers do (the token count is
            # this rank's times the rank count: exact with one forwarder, an estimate with more).
            meta["batch_num_tokens"] = int(mini_batch["response_mask"].values().sum()) * self.world_size
            meta["global_batch_size"] = mini_batch_size
            meta[OLD_LOG_PROBS_CURRENT] = current
            for key, value in self.backend_forward_backward(mini_batch, dict(meta)).items():
                metrics.setdefault(key, []).append(float(value))
            for key, value in self.backend_optimizer_step().items():
                metrics.setdefault(key, []).append(float(value))
            current = False
        lr = self.backend_end_of_step()
        if lr is not None:
            # The learning rate the optimizer steps used, when the backend reported it; else the schedule's.
            metrics.setdefault("lr", [lr])
        elapsed = time.perf_counter() - start
        seqlens = data["input_ids"].offsets().diff().tolist()
        out: dict[str, Any] = {key: values for key, values in metrics.items()}
        out["mfu"] = self._mfu(seqlens, elapsed, epochs)
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": out})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "naive") -> None:
        if self.rank == 0:
            await self.backend.update_weights()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def save_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, global_step: int = 0, max_ckpt_to_keep: int | None = None
    ) -> None:
        if self.rank == 0:
            os.makedirs(local_path, exist_ok=True)
            await self.backend.save_checkpoint(int(global_step), local_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = False
    ) -> None:
        if self.rank == 0:
            await self.backend.load_checkpoint(_step_of(local_path), local_path)

    # verl's profiler (global_profiler.steps): verl starts and stops a profile around each profiled step.
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def start_profile(self, **kwargs: Any) -> None:
        if not self.backend_start_profile(**kwargs) and not self._profile_noted:
            self._profile_noted = True
            log.warning(
                "verl-remote: global_profiler.steps asks for a profile; the forwarders only forward, and backend "
                "'%s' does not profile its service through verl (its worker's backend_start_profile): profile the "
                "service with its own tools",
                self.backend_name,
            )

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def stop_profile(self, run_command: bool = True) -> None:
        self.backend_stop_profile(run_command=run_command)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step_profile(self) -> None:
        pass

    # -- what a backend's worker implements ------------------------------------------------

    def backend_log_probs(
        self, data: TensorDict, *, temperature: float, calculate_entropy: bool, reference: bool
    ) -> tuple[Any, Any]:
        """Jagged ``(log_probs, entropy)`` over each row of ``data["input_ids"]``.

        Position ``t`` holds ``log p(input_ids[t+1])`` at ``temperature``; the last position of a row is 0, so
        response token ``j`` of a row of ``n`` tokens with ``r`` response tokens is at ``n - r - 1 + j``
        (:mod:`verl_remote.kit.compute`). ``data`` also holds ``prompts``, ``responses`` and ``response_mask``.
        ``entropy`` may be zeros when not asked for. ``reference``: score with the initial weights.
        """
        raise NotImplementedError

    def backend_forward_backward(self, mini_batch: TensorDict, meta: dict[str, Any]) -> dict[str, float]:
        """One forward-backward pass of verl's actor loss on ``mini_batch``; returns its metrics.

        ``meta``: ``temperature``, ``calculate_entropy``, ``dp_size``,
        ``batch_num_tokens`` and ``global_batch_size`` (for verl's loss aggregation), and
        ``old_log_probs_current`` (:data:`OLD_LOG_PROBS_CURRENT`); the loss settings are in
        ``self.config.actor``. :func:`verl_remote.kit.compute.actor_loss` computes verl's loss from them. Return
        at least ``loss``, as plain floats without the ``actor/`` prefix (docs/backend-author-guide.md).
        """
        raise NotImplementedError

    def backend_optimizer_step(self) -> dict[str, float]:
        """Apply the accumulated gradients; returns at least ``grad_norm`` and ``lr``."""
        raise NotImplementedError

    def backend_end_of_step(self) -> float | None:
        """Called once per training step after the last mini-batch (the LR schedule steps here)."""
        return None

    def backend_start_profile(self, **kwargs: Any) -> bool:
        """Optional: start the service's profiler for a step verl profiles (``global_profiler.steps``; ``kwargs``
        as verl sends them: ``profile_step``, ``role``). Return True when it does; the default does nothing (the
        run says so once)."""
        return False

    def backend_stop_profile(self, *, run_command: bool) -> None:
        """Optional: stop it; ``run_command`` is True on the last profiled step (verl's trace-upload hook)."""

    # -- plumbing --------------------------------------------------------------------------

    def _log_probs(self, data: TensorDict, *, reference: bool) -> TensorDict:
        log_probs, entropy = self.backend_log_probs(
            data,
            temperature=float(tu.get(data, "temperature", 1.0)),
            calculate_entropy=bool(tu.get(data, "calculate_entropy", not reference)),
            reference=reference,
        )
        return tu.get_tensordict(tensor_dict={"log_probs": log_probs, "entropy": entropy}, non_tensor_dict={})

    def backend_device_name(self) -> str | None:
        """The accelerator the backend trains on ("NVIDIA H100 80GB HBM3", "CPU"), for MFU; None: unknown."""
        return None

    def backend_flops(self, seqlens: list[int]) -> float | None:
        """FLOPs of one forward and backward pass over sequences of these lengths on the service, for MFU.

        None (the default): verl's formula for the Hugging Face config at the model path, which is right only
        when the service trains that architecture.
        """
        return None

    def _mfu(self, seqlens: list[int], elapsed: float, epochs: int) -> float:
        """Model FLOPs utilisation of the backend's device, as verl computes it for its own workers.

        verl's ``FlopsCounter.estimate_flops`` asks torch in *this* process for the
        device, which on a CPU-only forwarder is wrong; so the estimate uses verl's
        per-architecture formula and the peak comes from the backend's device name.
        """
        device = self.backend_device_name()
        if elapsed <= 0 or device is None:
            return 0.0
        from verl.utils.flops_counter import ESTIMATE_FUNC, get_device_flops

        flops = self.backend_flops(seqlens)
        if flops is not None:
            achieved = float(flops) * epochs / elapsed / 1e12  # TFLOPS, as verl's estimates
        else:
            estimate = ESTIMATE_FUNC.get(self._flops.config.model_type) if self._flops is not None else None
            if estimate is None:
                return 0.0
            achieved = estimate(self._flops.config, sum(seqlens), seqlens, elapsed) * epochs
        peak = get_device_flops(device_name=device)
        return float(achieved / peak / self.world_size) if 0 < peak < float("inf") else 0.0


def _mini_batches(tensors: TensorDict, size: int, epochs: int, seed: Any, dataloader_kwargs: dict[str, Any]) -> Any:
    """verl's mini-batches of ``tensors`` (``make_iterator``); where that is the whole batch once, in order (one
    epoch, no shuffle, a mini-batch as large as the batch: every backend's default), the batch itself, without a
    copy of every row (verl's loader selects them all by index)."""
    if epochs == 1 and size >= len(tensors) and not dataloader_kwargs.get("shuffle", False):
        return [tensors]
    return tu.make_iterator(
        tensors, mini_batch_size=size, epochs=epochs, seed=seed, dataloader_kwargs=dataloader_kwargs
    )


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _step_of(path: str) -> int:
    match = re.search(r"global_step_(\d+)", path)
    if match is None:
        raise ValueError(f"cannot tell the training step of checkpoint path {path!r} (no 'global_step_N' in it)")
    return int(match.group(1))


def _flops_counter(model_path: str) -> Any:
    """verl's FlopsCounter for the model, or None when its config cannot be read here."""
    try:
        from transformers import AutoConfig
        from verl.utils.flops_counter import FlopsCounter

        return FlopsCounter(AutoConfig.from_pretrained(model_path))
    except Exception as exc:  # a remote-only model id, an unknown architecture
        log.warning("verl-remote: no MFU for %s (%s); reporting 0", model_path, exc)
        return None
