"""The local backend's rollout server: each request is sampled by the engine actor.

Light on purpose (no torch, no verl at import): Ray imports this module wherever a handle to the server arrives.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_remote import RemoteRolloutServer, SampleResult, SamplingParams

if TYPE_CHECKING:
    from verl_remote.backends.local.backend import LocalBackend

__all__ = ["LocalRolloutServer"]


class LocalRolloutServer(RemoteRolloutServer):
    backend: LocalBackend

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        result = await self.backend.generate(prompt_ids, params)
        return SampleResult(result.token_ids, result.log_probs, result.stop_reason)
