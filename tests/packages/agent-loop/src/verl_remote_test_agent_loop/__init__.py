"""A deterministic multi-turn agent loop: the model answers, the environment speaks, the model answers again.

Built as verl's own tool agent loop builds a trajectory (verl/experimental/agent_loop/tool_agent_loop.py): the
model's tokens merged with ``ct_merge_assistant_token`` (mask 1, their sampled log-probs), the environment's
turn rendered by the chat template and merged with ``ct_merge_context_msg`` (mask 0, log-prob 0.0), each turn a
``server_manager.generate`` call on the run's rollout replica. The environment repeats the last word of the
user's first message (the demo's digit), so the observation's tokens are known to the tests:
``user: <word> <|im_end|> assistant:`` with the demo's chat template.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

__all__ = ["CONFIG", "TwoTurnAgentLoop"]

#: The file to pass as actor_rollout_ref.rollout.agent.agent_loop_config_path (it names this loop "two_turn").
CONFIG = str(files(__name__) / "agent_loops.yaml")


class TwoTurnAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        budget = int(self.rollout_config.response_length)
        messages = list(kwargs["raw_prompt"])
        prompt_ids = await self.ct_build_initial_tokens(messages)
        tokens = list(prompt_ids)
        mask: list[int] = []
        logprobs: list[float] | None = [] if sampling_params.get("logprobs") else None
        extra: dict[str, Any] = {}
        request_id = uuid4().hex  # one per trajectory, as verl's tool agent loop sends (a sticky session)
        # The first answer is short, so that the environment's turn and a second answer fit the response.
        first = max(1, budget // 4)
        for turn, max_tokens in enumerate((first, None)):
            left = budget - len(mask)
            if left < 1:
                break
            params = {**sampling_params, "max_tokens": min(max_tokens or left, left)}
            output = await self.server_manager.generate(request_id, prompt_ids=tokens, sampling_params=params)
            # The first call's version tags, the last call's newest version (as verl's tool agent loop keeps them).
            extra = dict(output.extra_fields) if turn == 0 else {**extra, **_newest(output.extra_fields)}
            merged, mask, logprobs = await self.ct_merge_assistant_token(
                tokens, output.token_ids, mask, logprobs, assistant_logprobs=output.log_probs
            )
            tokens = merged.token_ids
            if turn == 0:
                answer = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
                said = {"role": "assistant", "content": answer}
                heard = {"role": "user", "content": str(messages[0]["content"]).split()[-1]}
                merged, mask, logprobs = await self.ct_merge_context_msg(
                    [*messages, said], [*messages, said, heard], tokens, mask, logprobs
                )
                tokens = merged.token_ids
                messages = [*messages, said, heard]
        response = tokens[len(prompt_ids) :]
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=response[:budget],
            response_mask=mask[:budget],
            response_logprobs=logprobs[:budget] if logprobs is not None else None,
            num_turns=4,  # the user, the model, the environment, the model
            metrics=AgentLoopMetrics(),
            extra_fields={**extra, "turn_scores": [], "tool_rewards": []},
        )


def _newest(fields: dict[str, Any]) -> dict[str, Any]:
    return {"max_global_steps": fields["max_global_steps"]} if "max_global_steps" in fields else {}
