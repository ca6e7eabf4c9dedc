"""The Tinker rollout server: each generation request is one ``SamplingClient.sample`` of the current weights.

Every replica samples through the run's one session, whose sampler is replaced at each weight sync, so all
replicas switch to the new weights together. verl's temperature, top-p and top-k go as Tinker's
``SamplingParams`` (temperature 0: greedy, as verl's validation asks), the model's EOS ids as ``stop``; the
sampled tokens' log-probs come back with them. Tinker's stop reasons "stop" and "length" are both verl's
"completed".

It imports no verl at import time: Ray imports a server class's module wherever a handle to the server arrives
(verl's request balancer, for one). The replica is :mod:`verl_remote_tinker.rollout`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from verl_remote import RemoteRolloutServer, SampleResult, SamplingParams

if TYPE_CHECKING:
    from verl_remote_tinker.backend import TinkerBackend

__all__ = ["TinkerRolloutServer"]


class TinkerRolloutServer(RemoteRolloutServer):
    backend: TinkerBackend

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        result = await self.backend.sample(prompt_ids, params)
        return SampleResult(list(result["tokens"]), result["logprobs"], "completed")

    async def sample_group(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SampleResult]:
        # A prompt's group as one SamplingClient.sample with num_samples=n: one call to the session, one request.
        results = await self.backend.sample_group(prompt_ids, params, n)
        return [SampleResult(list(r["tokens"]), r["logprobs"], "completed") for r in results]
