"""The Arctic forwarder's dense layout, checked against values written out by hand."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from verl_arctic.worker import from_dense, response_aligned, to_dense

PAD = 0


def _jagged(rows: list[list[float]], dtype: torch.dtype) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _verl_batch() -> TensorDict:
    # Row 0: prompt of 3, response of 2. Row 1: prompt of 2, response of 3.
    prompts = [[11, 12, 13], [21, 22]]
    responses = [[14, 15], [23, 24, 25]]
    return TensorDict(
        {
            "prompts": _jagged(prompts, torch.int64),
            "responses": _jagged(responses, torch.int64),
            "old_log_probs": _jagged([[-0.1, -0.2], [-0.3, -0.4, -0.5]], torch.float32),
        },
        batch_size=[2],
    )


def test_prompts_are_left_padded_and_responses_right_padded() -> None:
    batch, p_lens, r_lens, width_p = to_dense(_verl_batch(), PAD)
    assert (p_lens, r_lens, width_p) == ([3, 2], [2, 3], 3)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 14, 15, 0], [0, 21, 22, 23, 24, 25]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
    assert batch["prompts"].tolist() == [[11, 12, 13], [0, 21, 22]]
    assert batch["responses"].tolist() == [[14, 15, 0], [23, 24, 25]]


def test_response_aligned_values_are_left_padded_by_the_prompt_width() -> None:
    out = response_aligned(_verl_batch()["old_log_probs"], width_p=3, width_r=3, dtype=torch.float32)
    expected = [[0, 0, 0, -0.1, -0.2, 0], [0, 0, 0, -0.3, -0.4, -0.5]]
    assert torch.allclose(out, torch.tensor(expected))


def test_dense_roll_minus_one_output_becomes_verls_jagged_rows() -> None:
    # Arctic's forward: position i holds log p(token i+1); padding holds pad_token_id; row ends hold garbage.
    dense = torch.tensor(
        [
            [-1.0, -2.0, -3.0, -4.0, 99.0, PAD],  # row 0 occupies columns 0..4
            [PAD, -5.0, -6.0, -7.0, -8.0, 99.0],  # row 1 occupies columns 1..5
        ]
    )
    rows = from_dense(dense, p_lens=[3, 2], r_lens=[2, 3], width_p=3).unbind(0)
    assert rows[0].tolist() == [-1.0, -2.0, -3.0, -4.0, 0.0]
    assert rows[1].tolist() == [-5.0, -6.0, -7.0, -8.0, 0.0]
    # verl then reads response token j of row 0 at index P-1+j: log p(14) = -3, log p(15) = -4.
    assert [rows[0][3 - 1 + j].item() for j in range(2)] == [-3.0, -4.0]
