"""The local backend's rollout replica: each request is sampled by the engine actor."""

from __future__ import annotations

from typing import Any, ClassVar

from verl_remote.backends.local.backend import LocalBackend
from verl_remote.rollout import RemoteRolloutReplica, RemoteRolloutServer, SampleResult

__all__ = ["LocalRolloutReplica", "LocalRolloutServer"]


class LocalRolloutServer(RemoteRolloutServer):
    backend: LocalBackend

    async def sample(self, prompt_ids: list[int], max_tokens: int, sampling_params: dict[str, Any]) -> SampleResult:
        params = {
            "temperature": float(sampling_params.get("temperature", 1.0)),
            "top_p": float(sampling_params.get("top_p", 1.0)),
            "top_k": int(sampling_params.get("top_k", -1)),
            "logprobs": bool(sampling_params.get("logprobs", False)),
            "stop_token_ids": self.stop_token_ids,
        }
        result = await self.backend.generate(prompt_ids, max_tokens, params)
        return SampleResult(result.token_ids, result.log_probs, result.stop_reason)


class LocalRolloutReplica(RemoteRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = LocalRolloutServer
