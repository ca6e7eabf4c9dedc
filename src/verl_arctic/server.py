"""The Arctic rollout server: verl's token-in/token-out requests through Arctic's text-in /generate.

It imports no verl and no torch at import time: Ray imports a server class's module wherever a handle to the
server arrives (verl's request balancer, for one). The replica is :mod:`verl_arctic.rollout`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from verl_remote import RemoteRolloutServer, SampleResult, SamplingParams

if TYPE_CHECKING:
    from verl_arctic.backend import ArcticBackend

__all__ = ["ArcticRolloutServer", "sampled_log_probs"]


def sampled_log_probs(result: dict[str, Any], tokens: list[int], url: str) -> list[float]:
    """The log-prob of each sampled token from a /generate result (one ``{token_id: {"logprob"}}`` per token).

    verl asks for them when ``actor_rollout_ref.rollout.calculate_log_probs`` is on; a server whose answer
    lacks them is named with what it sent, and the setting that avoids asking.
    """
    entries = result.get("logprobs")
    fix = "set actor_rollout_ref.rollout.calculate_log_probs=false to train without sampled log-probs"
    if not isinstance(entries, list) or len(entries) != len(tokens):
        got = "no 'logprobs'" if entries is None else f"'logprobs' of {type(entries).__name__} {str(entries)[:200]}"
        raise ValueError(
            f"Arctic's /generate at {url} was asked for sampled log-probs (logprobs=0) but answered with {got} for "
            f"{len(tokens)} sampled tokens (answer keys: {sorted(result)}); {fix}"
        )
    out = []
    for position, (entry, token) in enumerate(zip(entries, tokens, strict=True)):
        found = entry.get(str(token), entry.get(token)) if isinstance(entry, dict) else None
        if not isinstance(found, dict) or "logprob" not in found:
            raise ValueError(
                f"Arctic's /generate at {url} answered without the log-prob of sampled token {token} at position "
                f"{position} (its entry: {str(entry)[:200]}); {fix}"
            )
        out.append(float(found["logprob"]))
    return out


class ArcticRolloutServer(RemoteRolloutServer):
    backend: ArcticBackend

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _ = self.tokenizer  # each request decodes its prompt: loaded as the server starts, not at its first request

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        # Arctic's /generate takes text: the prompt goes back through the tokenizer, special tokens kept. Its
        # sampling parameters are vLLM's: the stop ids (the model's EOS and any an agent loop adds) end a response.
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        body = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k if params.top_k > 0 else 0,
            "repetition_penalty": params.repetition_penalty,
            "max_tokens": params.max_tokens,
            "stop_token_ids": list(params.stop_token_ids),
            "logprobs": 0 if params.logprobs else None,
        }
        result = await self.backend.generate(prompt, body)
        tokens = [int(t) for t in result["token_ids"]]
        log_probs = sampled_log_probs(result, tokens, self.backend.client.url) if params.logprobs else None
        stop = "aborted" if result.get("finish_reason") == "abort" else "completed"
        return SampleResult(tokens, log_probs, stop)

    async def clear_kv_cache(self) -> None:
        # The run's new weights are in (update_weights): what the sampler cached of prompts under the old ones goes
        # before the next request (Arctic's prefix cache).
        await self.backend.reset_prefix_cache()

    async def sleep(self) -> None:
        # Free the sampler's memory for the trainer between rollouts, where they share GPUs; update_weights wakes
        # it with the new weights. Separate engines (remote_backend.colocate=false) have nothing to give back.
        if self.backend.colocated:
            await self.backend.sleep_sampling()
