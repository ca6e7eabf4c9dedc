"""The rollout replica's sampling contract, enforced once for every backend (verl_remote.integration.rollout)."""

from __future__ import annotations

import pytest

from verl_remote import SampleResult, SamplingParams
from verl_remote.integration.rollout import within_contract


def test_an_agent_loops_stop_ids_add_to_the_models_eos_and_end_the_response_after_the_first() -> None:
    # verl's tool agent loop adds its tool parser's stop ids to the request (tool_agent_loop.py, generating state).
    params = SamplingParams.from_verl(
        {"temperature": 0.7, "stop_token_ids": [9, 2], "logprobs": True}, max_tokens=6, stop_token_ids=[2]
    )
    assert params.stop_token_ids == (2, 9) and params.temperature == 0.7 and params.logprobs
    cut = within_contract(SampleResult([4, 9, 5, 2], [-0.1, -0.2, -0.3, -0.4], "aborted"), params)
    assert (cut.token_ids, cut.log_probs, cut.stop_reason) == ([4, 9], [-0.1, -0.2], "completed")
    # Without the request's ids, the model's EOS alone ends it.
    plain = SamplingParams.from_verl({}, max_tokens=6, stop_token_ids=[2])
    assert within_contract(SampleResult([4, 9, 5, 2, 7]), plain).token_ids == [4, 9, 5, 2]


def test_stop_strings_are_refused_naming_the_token_id_parameter() -> None:
    with pytest.raises(ValueError, match=r"stop on token ids only; have the agent loop pass .*stop_token_ids"):
        SamplingParams.from_verl({"stop": ["</tool_call>"]}, max_tokens=4, stop_token_ids=[2])
