"""The rollout server: each sampling request is one call to the bigram service.

A module of its own that imports no verl (the face's RemoteRolloutServer imports none): Ray imports a server
class's module in every process that receives a handle to the server, verl's request balancer among them.
"""

from __future__ import annotations

from verl_remote import RemoteRolloutServer, SampleResult, SamplingParams


class BigramServer(RemoteRolloutServer):
    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        if params.top_p < 1.0 or params.top_k > 0:
            raise ValueError("the bigram example samples the full distribution: set rollout top_p=1 and top_k=-1")
        tokens, log_probs = await self.backend.service.call_async(
            "sample", prompt_ids, params.max_tokens, params.temperature, list(params.stop_token_ids)
        )
        return SampleResult(tokens, log_probs)
