"""An exported model folder loaded with vLLM and with transformers: the log-probs each gives the same sequences
agree (fp32 both). Run in an environment with vLLM (tests/test_fresh_venv.py, the vLLM test):
``python tests/vllm_loads_export.py MODEL_DIR [MODEL_DIR ...]``, one line per folder."""

from __future__ import annotations

import gc
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main(path: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    rows = [tokenizer.encode(text) for text in ("user: 7 + 5 = ? assistant: 12", "user: 3 <|im_end|> assistant: 9 9")]
    llm = LLM(model=path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 26, enforce_eager=True)
    prompts = [TokensPrompt(prompt_token_ids=row) for row in rows]
    answers = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    worst = 0.0
    with torch.no_grad():
        for row, answer in zip(rows, answers, strict=True):
            theirs = torch.tensor([answer.prompt_logprobs[t][row[t]].logprob for t in range(1, len(row))])
            logits = model(input_ids=torch.tensor([row])).logits[0, :-1]
            ours = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(row[1:])[:, None])[:, 0]
            worst = max(worst, float((ours - theirs).abs().max()))
    del llm  # its engine's processes end before the next folder's start
    gc.collect()
    print(f"vLLM and transformers agree on {path} to {worst:.2g}", flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a process of its own
    for folder in sys.argv[1:]:
        main(folder)
