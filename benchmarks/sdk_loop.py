"""A remote step beside the simplest loop a user could write instead: the Tinker demo through verl-remote, and a
plain tinker-SDK GRPO loop, on the same SkyRL Tinker server, task, batch and number of steps.

    python benchmarks/sdk_loop.py [--steps 30] [--also OVERRIDE ...]

Starts SkyRL's Tinker server on this machine (``verl_remote_tinker.testing.local_server``; its environment is built
once and reused), then on it, one after the other:

- the SDK loop, in the style of tinker-cookbook's RL loop: each step samples the demo's 8 prompts x 8 from the
  sampler of the current weights (the prompts through the model's chat template, as verl's data set makes them),
  scores them with the demo's reward, takes GRPO's advantages (each group's rewards less their mean, over their
  standard deviation), sends one ``forward_backward`` with the ``importance_sampling`` loss on the sampler's
  log-probs, one ``optim_step`` (Adam at the recipe's rate), and ``save_weights_and_get_sampling_client`` for the
  next step's sampler;
- ``verl-remote train --recipe configs/tinker-local-server.yaml`` with the same number of steps, no validation and
  no checkpoints.

``--also`` runs ``verl-remote train`` once more after the first, with those overrides added (say
``remote_old_log_probs.source=recompute``: a before and after on one server). Prints each one's median step time
(the steps after the first 3) and its mean reward over the first and the last 3 steps, and each one's start-up:
the seconds from its command to its first step's line and the CPU-seconds of its processes by then (the SDK loop
runs as a process of its own, ``--sdk-only``, so that its imports count as verl-remote's do). Needs verl-remote-tinker
(pip install ./dists/verl-remote-tinker). The figures of record are in docs/measurements.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from processes import Watched, watch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "configs" / "tinker-local-server.yaml"
WARM_STEPS = 3  # the first steps compile the server's programs for their shapes: not counted in the median
SDK_STEP = re.compile(r"^  sdk step (\d+)/\d+: ([\d.]+) s, reward ([-\d.]+)$")
FIRST_STEP = {"sdk": re.compile(r"^  sdk step 1/"), "verl-remote": re.compile(r"^step 1/")}


def demo_task() -> tuple[list[list[int]], list[str], dict[str, Any]]:
    """The demo's prompts as token ids and their answers, and the recipe's settings the loop uses."""
    from transformers import AutoTokenizer

    from verl_remote.demo import resolve_demo_assets
    from verl_remote.discovery.compose import compose_config

    config = compose_config(["remote_backend.base_url=http://127.0.0.1:1"], recipe=str(RECIPE))
    resolve_demo_assets(config)
    import pandas as pd

    tokenizer = AutoTokenizer.from_pretrained(str(config.actor_rollout_ref.model.path))
    rows = pd.read_parquet(str(config.data.train_files))
    prompts = [  # as verl's data set makes them: the chat template's text, then its tokens
        tokenizer.encode(
            tokenizer.apply_chat_template(list(row.prompt), add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for row in rows.itertuples()
    ]
    answers = [str(row.reward_model["ground_truth"]) for row in rows.itertuples()]
    settings = {
        "model": str(config.actor_rollout_ref.model.path),
        "batch": int(config.data.train_batch_size),
        "n": int(config.actor_rollout_ref.rollout.n),
        "max_tokens": int(config.data.max_response_length),
        "lr": float(config.actor_rollout_ref.actor.optim.lr),
        "lora_rank": int(config.remote_backend.lora_rank),
        "eos": [int(tokenizer.eos_token_id)],
        "decode": tokenizer.decode,
    }
    return prompts, answers, settings


async def sdk_loop(
    url: str, steps: int, *, batch: int | None = None, on_step: Callable[[], None] | None = None
) -> tuple[list[float], list[float]]:
    """The plain loop; each step's seconds and mean reward. ``batch``: prompts a step (the recipe's by default);
    ``on_step`` is called as each step ends."""
    import numpy as np
    from tinker import types

    from verl_remote.demo.reward import compute_score
    from verl_remote_tinker import sdk  # each call as the SDK in this environment takes it (0.25 or newer)

    prompts, answers, s = demo_task()
    if batch is not None:
        s["batch"] = batch
    service = sdk.service_client(url, "tml-no-key-set", timeout_s=600, max_retries=0)
    training = await sdk.created(service, "create_lora_training_client", base_model=s["model"], rank=s["lora_rank"])
    sampler = await sdk.saved_for_sampling(training)
    params = types.SamplingParams(max_tokens=s["max_tokens"], temperature=1.0, stop=s["eos"])
    times, rewards = [], []
    for step in range(steps):
        began = time.monotonic()
        first = (step * s["batch"]) % len(prompts)
        chosen = [(prompts[i % len(prompts)], answers[i % len(prompts)]) for i in range(first, first + s["batch"])]
        samples = await asyncio.gather(
            *[sdk.requested(sampler, "sample", types.ModelInput.from_ints(p), s["n"], params) for p, _ in chosen]
        )
        data, scores = [], []
        for (prompt, answer), result in zip(chosen, samples, strict=True):
            texts = [s["decode"](q.tokens, skip_special_tokens=True) for q in result.sequences]
            group = [compute_score("verl_remote/say_digit", text, answer) for text in texts]
            scores.extend(group)
            mean, std = float(np.mean(group)), float(np.std(group, ddof=1))
            for q, score in zip(result.sequences, group, strict=True):
                advantage = (score - mean) / (std + 1e-6)
                tokens = prompt + list(q.tokens)
                pad = [0.0] * (len(prompt) - 1)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": types.TensorData(data=tokens[1:], dtype="int64"),
                            "weights": types.TensorData(data=pad + [1.0] * len(q.tokens), dtype="float32"),
                            "logprobs": types.TensorData(data=pad + list(q.logprobs), dtype="float32"),
                            "advantages": types.TensorData(data=pad + [advantage] * len(q.tokens), dtype="float32"),
                        },
                    )
                )
        update = await sdk.submitted(training, "forward_backward", data, "importance_sampling")
        optim = await sdk.submitted(training, "optim_step", types.AdamParams(learning_rate=s["lr"]))
        await sdk.resolved(update)
        await sdk.resolved(optim)
        sampler = await sdk.saved_for_sampling(training)
        times.append(time.monotonic() - began)
        rewards.append(float(np.mean(scores)))
        if on_step is not None:
            on_step()
        print(f"  sdk step {step + 1}/{steps}: {times[-1]:.2f} s, reward {rewards[-1]:.3f}", flush=True)
    return times, rewards


def verl_remote(url: str, steps: int, folder: Path, *also: str) -> tuple[list[float], list[float]]:
    """``verl-remote train`` on the same server; each step's seconds and mean reward, from verl's metrics lines."""
    cli = "from verl_remote.cli.main import console_main; console_main()"
    overrides = [
        f"remote_backend.base_url={url}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={folder / 'ckpt'}",
        *also,
    ]
    command = [sys.executable, "-c", cli, "train", "--recipe", str(RECIPE), *overrides]
    run = watch(command, cwd=str(folder), mark=FIRST_STEP["verl-remote"])
    if run.code != 0:
        raise RuntimeError(f"verl-remote train failed ({run.code}): {[line for _, line in run.lines[-3:]]}")
    START_UP.append(("verl-remote train", first_step(run)))
    log = sorted((folder / "ckpt" / "logs").glob("train-*.log"))[-1].read_text()

    def metric(name: str) -> list[float]:
        return [float(part.split(":", 1)[1]) for part in log.split() if part.startswith(f"{name}:")]

    phases = ("gen", "old_log_prob", "update_actor", "update_weights")
    print(
        "  verl-remote's phases, median s/step after the first 3: "
        + ", ".join(f"{p} {statistics.median(metric(f'timing_s/{p}')[WARM_STEPS:]):.2f}" for p in phases),
        flush=True,
    )
    return metric("timing_s/step"), metric("critic/score/mean")


#: (name, (seconds to the first step's line, CPU-seconds of its processes by then)) of each run, in order.
START_UP: list[tuple[str, tuple[float, float]]] = []


def first_step(run: Watched) -> tuple[float, float]:
    """Seconds from the command to its first step's line, and its processes' CPU-seconds then."""
    if not run.marks:
        raise RuntimeError("the run printed no first step")
    at, cpu = run.marks[0]
    return run.lines[at][0], sum(cpu.values())


def sdk_process(url: str, steps: int, folder: Path) -> tuple[list[float], list[float]]:
    """:func:`sdk_loop` as a process of its own (``--sdk-only``): each step's seconds and mean reward."""
    command = [sys.executable, str(Path(__file__).resolve()), "--sdk-only", url, "--steps", str(steps)]
    run = watch(command, cwd=str(folder), mark=FIRST_STEP["sdk"], on_line=lambda line: print(line, flush=True))
    if run.code != 0:
        raise RuntimeError(f"the SDK loop failed ({run.code}): {[line for _, line in run.lines[-3:]]}")
    START_UP.append(("tinker SDK loop", first_step(run)))
    rows = [m for _, line in run.lines if (m := SDK_STEP.match(line))]
    return [float(m.group(2)) for m in rows], [float(m.group(3)) for m in rows]


def summary(name: str, times: list[float], rewards: list[float]) -> tuple[float, str]:
    median = statistics.median(times[WARM_STEPS:])
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    return median, f"| {name} | {median:.2f} | {first:.3f} | {last:.3f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--also", nargs="+", default=[], metavar="OVERRIDE", help="a second verl-remote run's")
    parser.add_argument("--sdk-only", metavar="URL", help=argparse.SUPPRESS)  # the SDK loop's own process
    args = parser.parse_args()
    if args.sdk_only:
        asyncio.run(sdk_loop(args.sdk_only, args.steps))
        return
    if args.steps <= WARM_STEPS + 3:
        parser.error(f"--steps must be more than {WARM_STEPS + 3}")
    from verl_remote_tinker.testing.local_server import start_local_server

    with (
        tempfile.TemporaryDirectory(prefix="sdk-loop-") as tmp,
        start_local_server(workdir=Path(tmp) / "tinker-server") as server,
    ):
        print(f"SkyRL's Tinker server at {server.url}; the SDK loop, {args.steps} steps", flush=True)
        sdk = sdk_process(server.url, args.steps, Path(tmp))
        print(f"verl-remote train, {args.steps} steps", flush=True)
        folder = Path(tmp) / "verl-remote"
        folder.mkdir()
        ours = verl_remote(server.url, args.steps, folder)
        if args.also:
            print(f"verl-remote train {' '.join(args.also)}, {args.steps} steps", flush=True)
            (Path(tmp) / "also").mkdir()
            also = verl_remote(server.url, args.steps, Path(tmp) / "also", *args.also)
    sdk_s, sdk_row = summary("tinker SDK loop", *sdk)
    ours_s, ours_row = summary("verl-remote train", *ours)
    machine = f"this machine, {os.cpu_count()} CPUs"
    print(f"\nthe Tinker demo on SkyRL's Tinker server, {args.steps} steps of 8 prompts x 8 ({machine})\n")
    print("| loop | s/step (median after the first 3) | mean reward, first 3 steps | last 3 |")
    print("|---|---|---|---|")
    print(sdk_row)
    print(ours_row)
    if args.also:
        also_s, also_row = summary(f"verl-remote train {' '.join(args.also)}", *also)
        print(also_row)
    print(f"\nverl-remote's step: {ours_s / sdk_s:.2f}x the SDK loop's")
    print("\n| start-up | s to the first step's line | CPU-seconds by then |")
    print("|---|---|---|")
    for name, (seconds, cpu) in START_UP:
        print(f"| {name} | {seconds:.1f} | {cpu:.1f} |")
    (sdk_first, _), (ours_first, _) = START_UP[0][1], START_UP[1][1]
    print(f"\nverl-remote's first step: {ours_first / sdk_first:.2f}x the SDK loop's")
    if args.also:
        print(f"verl-remote's step with {' '.join(args.also)}: {also_s / sdk_s:.2f}x the SDK loop's")


if __name__ == "__main__":
    main()
