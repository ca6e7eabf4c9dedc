"""A rollout server of the echo backend whose answers follow from the prompt alone: the same prompt, the same
tokens and log-probs, of lengths that differ from prompt to prompt, or the same refusal (tests/test_agent_loop.py
compares verl's agent loop with verl-remote's on them)."""

from __future__ import annotations

from verl_remote import RemoteRolloutServer, SampleResult, SamplingParams


class EchoRefusal(ValueError):
    """What the echo server raises for a prompt whose token ids sum to a multiple of 4."""


class EchoServer(RemoteRolloutServer):
    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        if sum(prompt_ids) % 4 == 0:
            raise EchoRefusal(f"echo: a prompt whose ids sum to {sum(prompt_ids)}")
        stop = set(params.stop_token_ids)
        length = min(params.max_tokens, 1 + sum(prompt_ids) % 5)
        tokens = [t for t in (3 + (sum(prompt_ids) + i) % 20 for i in range(length * 2)) if t not in stop][:length]
        return SampleResult(tokens, [-0.25 * (i + 1) for i in range(len(tokens))])

    clears = 0

    async def clear_kv_cache(self) -> None:
        self.clears += 1  # what a sampler with a prefix cache drops there

    async def cleared(self) -> int:
        """How many times the server was asked to clear its cache (each new weights version)."""
        return self.clears
