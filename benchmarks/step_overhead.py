"""verl-remote's own per-step overhead, beside the backend's compute, at realistic batch sizes.

The forwarder's data path for one training step is measured piece by piece on
verl-shaped batches (jagged TensorDicts of prompt+response sequences):

- pack: verl's TensorDict fields -> numpy payload (``verl_remote.kit.payload``), for
  compute_log_prob and for update_actor;
- transfer: the payload to a Ray actor and back (the object store path the
  local backend uses), with an actor method that does no work;
- unpack: returned log-probs -> verl's jagged tensors and the result TensorDict;
- iterate: the mini-batch iterator over the update batch (verl's make_iterator).

The backend's compute is timed separately: the local engine's log-prob pass
and forward-backward on the same batch, in process, with the demo's tiny model
on this CPU. The overhead is reported as a share of (a) that measured step and
(b) an estimated GPU-scale step (a 7B model at 40% MFU on one H100-class GPU,
6 * params * tokens FLOPs for the update plus 2 * params * tokens for the
log-prob pass), which is where the target "under 1%" applies.

    python benchmarks/step_overhead.py [--batches 8,16,32,64] [--tokens 1024] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

GPU_PARAMS = 7e9
GPU_PEAK_FLOPS = 989e12
GPU_MFU = 0.4


def make_batch(sequences: int, tokens: int, vocab: int, seed: int = 0) -> Any:
    """A verl V1 update batch: jagged prompt+response rows, response-aligned training fields."""
    from verl.utils import tensordict_utils as tu

    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(tokens // 8, tokens // 4, size=sequences)
    response_lens = tokens - prompt_lens - rng.integers(0, tokens // 8, size=sequences)

    def jagged(lengths: np.ndarray, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return torch.nested.as_nested_tensor([make(int(n)) for n in lengths], layout=torch.jagged)

    prompts = [torch.from_numpy(rng.integers(4, vocab, size=int(n))) for n in prompt_lens]
    responses = [torch.from_numpy(rng.integers(4, vocab, size=int(n))) for n in response_lens]
    fields = {
        "prompts": torch.nested.as_nested_tensor(prompts, layout=torch.jagged),
        "responses": torch.nested.as_nested_tensor(responses, layout=torch.jagged),
        "input_ids": torch.nested.as_nested_tensor(
            [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)], layout=torch.jagged
        ),
        "response_mask": jagged(response_lens, lambda n: torch.ones(n, dtype=torch.int64)),
        "old_log_probs": jagged(response_lens, lambda n: -torch.rand(n)),
        "advantages": jagged(response_lens, lambda n: torch.randn(n)),
    }
    return tu.get_tensordict(fields, non_tensor_dict={})


def timed(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``repeat`` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class Sink:
    """A backend actor that does nothing: what is left is the transfer."""

    def log_probs(self, input_ids: Any) -> dict[str, np.ndarray]:
        n = int(input_ids.offsets[-1])
        return {"log_probs": np.zeros(n, np.float32), "entropy": np.zeros(n, np.float32)}

    def forward_backward(self, batch: Any, meta: dict[str, Any]) -> dict[str, float]:
        return {"loss": 0.0}


def measure(engine: Any, sink: Any, batch: Any, repeat: int) -> tuple[Any, ...]:
    """One row of the table: verl-remote's pieces, the backend's compute, the GPU-scale estimate."""
    import ray
    from verl.utils import tensordict_utils as tu

    from verl_remote.backends.local.worker import TRAIN_FIELDS
    from verl_remote.kit.payload import pack, pack_fields, unpack_like

    sequences = len(batch)
    tokens = int(batch["input_ids"].offsets()[-1])
    input_ids = pack(batch["input_ids"])
    train = pack_fields(batch, TRAIN_FIELDS)
    meta = {"temperature": 1.0, "calculate_entropy": False, "dp_size": 1}
    meta |= {"batch_num_tokens": int(batch["response_mask"].values().sum()), "global_batch_size": sequences}
    out = ray.get(sink.log_probs.remote(input_ids))

    def unpack() -> Any:
        log_probs = unpack_like(out["log_probs"], input_ids)
        entropy = unpack_like(out["entropy"], input_ids)
        return tu.get_tensordict({"log_probs": log_probs, "entropy": entropy}, non_tensor_dict={})

    def compute() -> None:
        engine.compute_log_prob(input_ids, 1.0, False, False)
        engine.forward_backward(train, meta)
        engine.optimizer.zero_grad(set_to_none=True)

    pack_s = timed(lambda: (pack(batch["input_ids"]), pack_fields(batch, TRAIN_FIELDS)), repeat)
    transfer_s = timed(
        lambda: ray.get([sink.log_probs.remote(input_ids), sink.forward_backward.remote(train, meta)]), repeat
    )
    unpack_s = timed(unpack, repeat)
    iterate_s = timed(lambda: list(tu.make_iterator(batch, mini_batch_size=sequences, epochs=1)), repeat)
    ours = pack_s + transfer_s + unpack_s + iterate_s
    compute_s = timed(compute, max(1, repeat // 2))
    gpu_s = 8 * GPU_PARAMS * tokens / (GPU_PEAK_FLOPS * GPU_MFU)
    return sequences, tokens, pack_s, transfer_s, unpack_s, iterate_s, ours, compute_s, gpu_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="8,16,32,64", help="sequences per step, comma separated")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per sequence (prompt+response), about")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--model", default=None, help="model path for the compute column (default: the demo model)")
    args = parser.parse_args()

    import ray
    from omegaconf import OmegaConf

    from verl_remote.backends.local.engine import LocalEngine
    from verl_remote.demo.assets import ensure_demo_assets
    from verl_remote.discovery.compose import compose_config

    model_path = args.model or str(ensure_demo_assets().model_path)
    config = compose_config([f"actor_rollout_ref.model.path={model_path}"], recipe="demo")
    OmegaConf.resolve(config)
    actor = OmegaConf.to_container(config.actor_rollout_ref.actor)
    engine = LocalEngine(model_path, actor, {"device": "cpu", "seed": 0})  # type: ignore[arg-type]
    vocab = int(engine.model.config.vocab_size)

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    sink = ray.remote(Sink).remote()
    rows = []
    try:
        for sequences in (int(b) for b in args.batches.split(",")):
            rows.append(measure(engine, sink, make_batch(sequences, args.tokens, vocab), args.repeat))
            print(f"measured {sequences} sequences", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()

    print(f"verl-remote per-step overhead, median of {args.repeat} runs, ~{args.tokens} tokens per sequence")
    print()
    print(
        "| sequences | tokens | pack | transfer | unpack | iterate | verl-remote total | "
        "tiny-model compute (CPU) | share of CPU step | est. 7B step on 1 GPU | share of GPU step |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for sequences, tokens, pack_s, transfer_s, unpack_s, iterate_s, ours, compute_s, gpu_s in rows:
        print(
            f"| {sequences} | {tokens} | {1e3 * pack_s:.1f} ms | {1e3 * transfer_s:.1f} ms | {1e3 * unpack_s:.1f} ms "
            f"| {1e3 * iterate_s:.1f} ms | {1e3 * ours:.1f} ms | {compute_s:.2f} s | "
            f"{100 * ours / (ours + compute_s):.2f}% | {gpu_s:.1f} s | {100 * ours / (ours + gpu_s):.3f}% |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
