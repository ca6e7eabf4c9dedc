"""One generation request's sampling, as a backend's rollout server is handed it, and what it returns.

verl's agent loop asks a replica for a response with vLLM-style ``sampling_params``; the replica parses them
once, with verl's defaults, into :class:`SamplingParams` and hands that to the backend's ``sample``, which
passes it on to its engine as it is. What ``sample`` returns (:class:`SampleResult`) is cut to the contract by
:func:`within_contract`. Free of verl and Ray: an engine in its own process unpickles these without importing
either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["SampleResult", "SamplingParams", "within_contract"]


@dataclass
class SampleResult:
    """What a backend returns for one generation request."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    #: "completed" (stop token or budget reached) or "aborted" (stopped early: verl continues the request).
    stop_reason: str = "completed"


@dataclass(frozen=True)
class SamplingParams:
    """One generation request's sampling, as verl's agent loop asks for it, with verl's defaults (those of its own
    vLLM rollout) where it leaves a key out."""

    #: The token budget: verl's response length, capped by the model length (RemoteRolloutServer.max_tokens).
    max_tokens: int
    #: The model's end-of-sequence ids, and those the request adds (verl's tool agent loop adds its tool parser's):
    #: the response ends right after the first one sampled.
    stop_token_ids: tuple[int, ...] = field(default=())
    #: 0 means greedy decoding (verl's validation default).
    temperature: float = 1.0
    top_p: float = 1.0
    #: -1 (or 0): no top-k cut.
    top_k: int = -1
    repetition_penalty: float = 1.0
    #: Whether one log-prob per sampled token is wanted (verl's rollout log-probs).
    logprobs: bool = False

    @classmethod
    def from_verl(
        cls, sampling_params: dict[str, Any], *, max_tokens: int, stop_token_ids: list[int] | tuple[int, ...]
    ) -> SamplingParams:
        def number(key: str, default: float) -> float:
            value = sampling_params.get(key)
            return default if value is None else float(value)

        if sampling_params.get("stop"):
            raise ValueError(
                f"sampling_params['stop'] ({sampling_params['stop']!r}): verl-remote's replicas stop on token ids "
                "only; have the agent loop pass sampling_params['stop_token_ids'] instead"
            )
        # vLLM's meaning, which verl's own rollout has: the request's stop ids add to the model's EOS.
        requested = sampling_params.get("stop_token_ids") or ()
        return cls(
            max_tokens=int(max_tokens),
            stop_token_ids=tuple(dict.fromkeys(int(t) for t in (*stop_token_ids, *requested))),
            temperature=number("temperature", 1.0),
            top_p=number("top_p", 1.0),
            top_k=int(number("top_k", -1)),
            repetition_penalty=number("repetition_penalty", 1.0),
            logprobs=bool(sampling_params.get("logprobs", False)),
        )


def within_contract(result: SampleResult, params: SamplingParams) -> SampleResult:
    """``result`` cut to what verl may receive: at most ``max_tokens`` tokens, ending right after the first stop
    id; log-probs only when asked for, one per token (a sampler that returns another count is refused)."""
    tokens = [int(t) for t in result.token_ids]
    log_probs = None if result.log_probs is None else [float(x) for x in result.log_probs]
    if params.logprobs and (log_probs is None or len(log_probs) != len(tokens)):
        got = "none" if log_probs is None else len(log_probs)
        raise ValueError(
            f"the sampler returned {got} log-probs for {len(tokens)} tokens; return one per sampled token when "
            "SamplingParams.logprobs is true"
        )
    if result.stop_reason not in ("completed", "aborted"):
        raise ValueError(f"the sampler's stop_reason is {result.stop_reason!r}; it must be 'completed' or 'aborted'")
    stops = set(params.stop_token_ids)
    end = next((i + 1 for i, token in enumerate(tokens) if token in stops), len(tokens))
    end = min(end, params.max_tokens)
    stop_reason = result.stop_reason if end == len(tokens) else "completed"
    tokens = tokens[:end]
    log_probs = log_probs[:end] if params.logprobs and log_probs is not None else None
    return SampleResult(tokens, log_probs, stop_reason)
