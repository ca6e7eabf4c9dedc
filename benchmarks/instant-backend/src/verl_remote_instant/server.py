"""The rollout server: every request answered at once with ``max_tokens`` tokens (no stop id among them)."""

from __future__ import annotations

from verl_remote import RemoteRolloutServer, SampleResult, SamplingParams


class InstantServer(RemoteRolloutServer):
    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        stop = set(params.stop_token_ids)
        token = next(t for t in (7, 8, 9, 10) if t not in stop)
        return SampleResult([token] * params.max_tokens, [0.0] * params.max_tokens)
