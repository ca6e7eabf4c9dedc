"""The reward of the "key word" task (make_task.py), in the signature verl calls a reward function with.

verl calls it once per response, with the row's ``data_source``, the decoded response, the row's
``reward_model["ground_truth"]`` and its ``extra_info``; it returns a float (or a dict with a ``score`` and
other values to log). Point verl at it with

    reward.custom_reward_function.path=examples/own-task/reward.py
    reward.custom_reward_function.name=key_word_reward
"""

from __future__ import annotations

from typing import Any


def key_word_reward(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None, **_: Any) -> float:
    """1 for an answer that is the key word alone; the share of the answer's words that are the key word otherwise."""
    words = [word.strip(".,!?()\"'").lower() for word in solution_str.replace("<|im_end|>", " ").split()]
    words = [word for word in words if word]
    if not words:
        return 0.0
    return sum(word == ground_truth for word in words) / len(words)
