"""The Tinker rollout replica: each generation request is one ``SamplingClient.sample`` of the current weights.

Every replica samples through the run's one session, whose sampler is replaced at each weight sync, so all
replicas switch to the new weights together. verl's temperature, top-p and top-k go as Tinker's
``SamplingParams`` (temperature 0: greedy, as verl's validation asks), the model's EOS ids as ``stop``; the
sampled tokens' log-probs come back with them. Tinker's stop reasons "stop" and "length" are both verl's
"completed".
"""

from __future__ import annotations

from typing import Any, ClassVar

from verl_remote.rollout import RemoteRolloutReplica, RemoteRolloutServer, SampleResult
from verl_remote_tinker.backend import TinkerBackend

__all__ = ["TinkerRolloutReplica", "TinkerRolloutServer"]


class TinkerRolloutServer(RemoteRolloutServer):
    backend: TinkerBackend

    async def sample(self, prompt_ids: list[int], max_tokens: int, sampling_params: dict[str, Any]) -> SampleResult:
        params = {
            "temperature": float(sampling_params.get("temperature", 1.0)),
            "top_p": float(sampling_params.get("top_p", 1.0)),
            "top_k": int(sampling_params.get("top_k", -1)),
            "stop": list(self.stop_token_ids),
        }
        result = await self.backend.sample(prompt_ids, max_tokens, params)
        tokens = list(result["tokens"])
        logprobs = result["logprobs"]
        # The contract: end after the first stop id emitted (a service may run on past one it was not told of).
        for index, token in enumerate(tokens):
            if token in self.stop_token_ids:
                tokens = tokens[: index + 1]
                logprobs = None if logprobs is None else logprobs[: index + 1]
                break
        wanted = bool(sampling_params.get("logprobs", False))
        return SampleResult(tokens, logprobs if wanted else None, "completed")


class TinkerRolloutReplica(RemoteRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = TinkerRolloutServer
