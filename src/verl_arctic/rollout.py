"""The Arctic rollout replica: verl's token-in/token-out requests through Arctic's text-in /generate."""

from __future__ import annotations

from typing import Any, ClassVar

from verl_arctic.backend import ArcticBackend
from verl_remote.rollout import RemoteRolloutReplica, RemoteRolloutServer, SampleResult

__all__ = ["ArcticRolloutReplica", "ArcticRolloutServer"]


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
        log_probs = None
        if want_logprobs:
            entries = result.get("logprobs") or []
            log_probs = [float(entry[str(token)]["logprob"]) for entry, token in zip(entries, tokens, strict=True)]
        stop = "aborted" if result.get("finish_reason") == "abort" else "completed"
        return SampleResult(tokens, log_probs, stop)

    async def sleep(self) -> None:
        # Free the sampler's memory between rollouts; update_weights wakes it with the new weights.
        await self.backend.sleep_sampling()


class ArcticRolloutReplica(RemoteRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = ArcticRolloutServer
