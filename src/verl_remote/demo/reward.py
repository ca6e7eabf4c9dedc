"""The demo's verifiable reward, in the signature verl's custom_reward_function expects.

verl-remote points ``reward.custom_reward_function.path`` at this file for the
demo, so verl calls :func:`compute_score` on every decoded response.

The task: the prompt "say 7" asks for the digit 7 as many times as fit in the
response. Each of the first TARGET_WORDS words earns 1 if it is the asked digit
and OTHER_DIGIT if it is another digit, so that a random model finds some signal
(digits) before it finds the right one.
"""

from __future__ import annotations

from typing import Any

#: Words a response needs to earn the full reward (the demo's response_length is this).
TARGET_WORDS = 8
#: Partial credit for a digit that is not the one asked for.
OTHER_DIGIT = 0.25


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    """Between 0 and 1: 1 when the response is the asked digit TARGET_WORDS times."""
    words = solution_str.replace("<|im_end|>", " ").split()[:TARGET_WORDS]
    credit = sum(1.0 if word == ground_truth else OTHER_DIGIT if word.isdigit() else 0.0 for word in words)
    return credit / TARGET_WORDS
