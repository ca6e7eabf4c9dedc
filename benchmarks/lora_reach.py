"""What a LoRA adapter on attention and MLP can reach on the demo's two models: the bound of verl_remote.demo.reach.

SkyRL's Tinker server trains attention and MLP only; the final norm and the output matrix stay as they are. For
the demo's model (output matrix = its input embeddings, tied, standard deviation 0.02) and for its LoRA variant
(an output matrix of its own), this prints the largest logit any token can reach, an upper bound on any token's
probability, and the best expected reward of the "say N" task, per asked digit and on average, at the demo's
sampling temperature (1.0). The Tinker recipe (configs/tinker-local-server.yaml) must end above 0.25; the model
it trains must at least allow it.

    python benchmarks/lora_reach.py [--cache DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from verl_remote.demo.assets import ensure_demo_assets
from verl_remote.demo.reach import lora_reach

TARGET = 0.25


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=None, help="the demo's cache folder (default: the user's)")
    args = parser.parse_args()
    assets = ensure_demo_assets(args.cache)
    for name, path in (("model", assets.model_path), ("lora-model", assets.lora_model_path)):
        began = time.perf_counter()
        reach = lora_reach(path)
        spent = time.perf_counter() - began
        per_digit = " ".join(f"{digit}:{value:.4f}" for digit, value in reach.best_reward_per_digit.items())
        verdict = "above" if reach.best_reward > TARGET else "below"
        print(
            f"verl-remote://demo/{name} ({'tied' if reach.tied else 'untied'}): largest logit {reach.max_logit:.3f} "
            f"(a digit's {reach.max_digit_logit:.3f}), a token's probability at most {reach.max_probability:.4f}; "
            f"best expected reward {reach.best_reward:.4f}, {verdict} "
            f"{TARGET} ({spent:.1f} s)\n    per digit {per_digit}"
        )


if __name__ == "__main__":
    main()
