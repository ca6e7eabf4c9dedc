"""The Arctic rollout replica: verl's token-in/token-out requests through Arctic's text-in /generate."""

from __future__ import annotations

from typing import Any, ClassVar

from verl_arctic.backend import ArcticBackend
from verl_remote.rollout import RemoteRolloutReplica, RemoteRolloutServer, SampleResult

__all__ = ["ArcticRolloutReplica", "ArcticRolloutServer"]


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

    async def sample(self, prompt_ids: list[int], max_tokens: int, sampling_params: dict[str, Any]) -> SampleResult:
        # Arctic's /generate takes text: the prompt goes back through the tokenizer, special tokens kept.
        prompt = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        want_logprobs = bool(sampling_params.get("logprobs"))
        top_k = int(sampling_params.get("top_k", -1))
        params = {
            "temperature": float(sampling_params.get("temperature", 1.0)),
            "top_p": float(sampling_params.get("top_p", 1.0)),
            "top_k": top_k if top_k > 0 else 0,
            "repetition_penalty": float(sampling_params.get("repetition_penalty", 1.0)),
            "max_tokens": max_tokens,
            "logprobs": 0 if want_logprobs else None,
        }
        result = await self.backend.generate(prompt, params)
        tokens = [int(t) for t in result["token_ids"]]
        log_probs = sampled_log_probs(result, tokens, self.backend.client.url) if want_logprobs else None
        stop = "aborted" if result.get("finish_reason") == "abort" else "completed"
        # Arctic stops at the model's EOS itself; any other stop id of the contract is applied here.
        end = next((i + 1 for i, token in enumerate(tokens) if token in self.stop_token_ids), len(tokens))
        if end < len(tokens):
            tokens, log_probs, stop = tokens[:end], None if log_probs is None else log_probs[:end], "completed"
        return SampleResult(tokens, log_probs, stop)

    async def sleep(self) -> None:
        # Free the sampler's memory between rollouts; update_weights wakes it with the new weights.
        await self.backend.sleep_sampling()


class ArcticRolloutReplica(RemoteRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = ArcticRolloutServer
