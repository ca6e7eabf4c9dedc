"""The local backend's rollout replica: each request is sampled by the engine actor."""

from __future__ import annotations

from typing import ClassVar

from verl_remote import RemoteRolloutReplica, RemoteRolloutServer, SampleResult, SamplingParams
from verl_remote.backends.local.backend import LocalBackend

__all__ = ["LocalRolloutReplica", "LocalRolloutServer"]


class LocalRolloutServer(RemoteRolloutServer):
    backend: LocalBackend

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        result = await self.backend.generate(prompt_ids, params)
        return SampleResult(result.token_ids, result.log_probs, result.stop_reason)


class LocalRolloutReplica(RemoteRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = LocalRolloutServer
