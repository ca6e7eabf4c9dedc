"""What the local backend's rollout server sends its engine and gets back: light on purpose (no torch), as the
server's process imports it."""

from __future__ import annotations

from dataclasses import dataclass

from verl_remote import SamplingParams

__all__ = ["GenerateResult", "SampleRequest"]


@dataclass
class SampleRequest:
    """One prompt to sample a response for, with verl's sampling parameters for it, as the replica parsed them."""

    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class GenerateResult:
    token_ids: list[int]
    log_probs: list[float] | None
    stop_reason: str  # "completed" (EOS or length) or "aborted"
    weights_version: int
