"""The demo's verifiable reward, in the signature verl's custom_reward_function expects.

verl-remote points ``custom_reward_function.path`` at this file for the demo, so
verl calls :func:`compute_score` on every decoded response.
"""

from __future__ import annotations

from typing import Any

#: Words a response needs to earn the full reward (the demo's response_length is this).
TARGET_WORDS = 8


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    """The share of TARGET_WORDS that are the digit the prompt asked for ("say 7" -> "7 7 7 ...")."""
    words = solution_str.replace("<|im_end|>", " ").split()[:TARGET_WORDS]
    return sum(word == ground_truth for word in words) / TARGET_WORDS
