"""Ray actors that hold a backend's forwarder worker and rollout server for the conformance checks.

Each runs in its own Ray worker process and re-attaches to the backend through its reconnect handle, as in a
training run; the checks call the four methods a backend author writes, without verl's trainer around them.
Batches travel as :class:`~verl_remote.kit.payload.Packed` arrays and come back the same way.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from verl_remote.kit.payload import Packed, pack, to_nested

__all__ = ["ServerHost", "WorkerHost"]


def _tensordict(fields: dict[str, Packed]) -> Any:
    from tensordict import TensorDict

    rows = len(next(iter(fields.values())))
    return TensorDict({key: to_nested(value) for key, value in fields.items()}, batch_size=[rows])


def _floats(metrics: Any) -> dict[str, Any]:
    return {str(k): (v if isinstance(v, str) else float(v)) for k, v in dict(metrics or {}).items()}


class WorkerHost:
    """The backend's forwarder worker, as verl builds it: one rank of one."""

    def __init__(self, backend_name: str, worker_config: Any, master_port: int) -> None:
        for key, value in {"WORLD_SIZE": "1", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(master_port))
        from verl_remote.discovery.registry import load_worker_class

        worker_class = load_worker_class(backend_name)

        def make(config: Any) -> Any:
            return worker_class(config, "actor_rollout")

        self._make = make
        self._config = worker_config
        self._workers: dict[str, Any] = {}
        self.worker = self._make(worker_config)
        self._workers["{}"] = self.worker

    def use_actor(self, settings: dict[str, Any]) -> None:
        """From now on, the forwarder of a run whose ``actor_rollout_ref.actor`` has ``settings`` (dotted keys)
        on top of the checked config's: a worker of its own, as each run builds (made once per settings)."""
        import json

        from omegaconf import OmegaConf, open_dict

        key = json.dumps(settings, sort_keys=True)
        if key not in self._workers:
            config = OmegaConf.create(OmegaConf.to_container(self._config, resolve=True))
            with open_dict(config):
                for name, value in settings.items():
                    OmegaConf.update(config.actor, name, value, force_add=True)
            self._workers[key] = self._make(config)
        self.worker = self._workers[key]

    def pid(self) -> int:
        return os.getpid()

    def log_probs(
        self, fields: dict[str, Packed], temperature: float, calculate_entropy: bool, reference: bool
    ) -> dict[str, np.ndarray]:
        log_probs, entropy = self.worker.backend_log_probs(
            _tensordict(fields), temperature=temperature, calculate_entropy=calculate_entropy, reference=reference
        )
        out = {"log_probs": pack(log_probs).values.astype(np.float64)}
        if entropy is not None:
            out["entropy"] = pack(entropy).values.astype(np.float64)
        return out

    def forward_backward(self, fields: dict[str, Packed], meta: dict[str, Any]) -> dict[str, Any]:
        return _floats(self.worker.backend_forward_backward(_tensordict(fields), dict(meta)))

    def optimizer_step(self) -> dict[str, Any]:
        return _floats(self.worker.backend_optimizer_step())

    def end_of_step(self) -> float | None:
        lr = self.worker.backend_end_of_step()
        return None if lr is None else float(lr)


class ServerHost:
    """The backend's rollout server, as verl's replica builds it."""

    def __init__(self, backend_name: str, rollout_config: Any, model_config: Any) -> None:
        from verl_remote.discovery.registry import load_rollout_class

        server_class = load_rollout_class(backend_name).server_class
        self.server = server_class(rollout_config, model_config, 0)
        self.eos = list(self.server.stop_token_ids)

    def pid(self) -> int:
        return os.getpid()

    def vocab_size(self) -> int:
        return len(self.server.tokenizer)

    async def set_global_steps(self, global_steps: int) -> None:
        """As the trainer tells its servers of new weights after a sync (which clears what they cached)."""
        await self.server.set_global_steps(global_steps)

    async def sample(
        self, prompt_ids: list[int], max_tokens: int, sampling_params: dict[str, Any], stop_token_ids: list[int] | None
    ) -> dict[str, Any]:
        from verl_remote.kit.sampling import SamplingParams

        stops = self.eos if stop_token_ids is None else list(stop_token_ids)
        params = SamplingParams.from_verl(dict(sampling_params), max_tokens=int(max_tokens), stop_token_ids=stops)
        # What verl receives: the backend's sample, cut to the contract as the server's generate cuts it.
        result = await self.server.sample_within_contract(list(prompt_ids), params)
        return {
            "token_ids": [int(t) for t in result.token_ids],
            "log_probs": None if result.log_probs is None else [float(x) for x in result.log_probs],
            "stop_reason": result.stop_reason,
        }
