"""Everything the no-argument demo needs, made locally: nothing is downloaded.

- a word-level tokenizer trained with ``tokenizers`` on a synthetic corpus,
  with a chat template (verl applies it to every prompt), saved so that both
  transformers 5 (verl) and transformers 4 (services such as Arctic's, which pin
  it) load it;
- a tiny Llama-architecture causal LM with random weights. Not Qwen: transformers 5
  replaces the tokenizer of a qwen2 model directory with its own BPE class, and verl's
  agent loop expects Qwen's own tokenizer for qwen2/qwen3 model types;
- the same model with an output matrix of its own (``lora-model``), for services that
  train a LoRA adapter on attention and MLP only (SkyRL's Tinker server): the demo model's
  output matrix is its input embeddings, tied, of standard deviation 0.02, and with the
  final norm frozen no logit such an adapter can produce exceeds 1.57, so the best expected
  reward it can reach is 0.221 (:mod:`verl_remote.demo.reach`). Untied, of standard
  deviation :data:`LORA_HEAD_STD`, the logits reach 7.53 and the reward 0.969;
- train and validation parquet files in verl's RL dataset format for the
  "say N" task: the prompt names a digit, the reward is the fraction of the
  response's words that are that digit (see :mod:`verl_remote.demo.reward`).

Assets are written once into a cache directory (atomically, so an interrupted
first run leaves nothing half-written) and reused. ``lora-model`` is added beside the
others to a cache made before it existed.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEMO_VERSION", "LORA_HEAD_STD", "DemoAssets", "default_cache_dir", "demo_assets_made", "ensure_demo_assets"]

# Bump when the assets change, so old caches are not reused.
DEMO_VERSION = "4"
DIGITS = [str(d) for d in range(10)]
FILLER = ["the", "a", "number", "is", "and", "ok", "yes", "no"]
SPECIAL = ["<pad>", "<unk>", "<|im_end|>"]
DATA_SOURCE = "verl_remote/say_digit"
#: The standard deviation of ``lora-model``'s output matrix (the demo model's, tied, is 0.02).
LORA_HEAD_STD = 0.1
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


@dataclass(frozen=True)
class DemoAssets:
    root: Path

    @property
    def model_path(self) -> Path:
        return self.root / "model"

    @property
    def lora_model_path(self) -> Path:
        """The demo model with an untied output matrix a LoRA on attention and MLP can use (see the module)."""
        return self.root / "lora-model"

    @property
    def train_file(self) -> Path:
        return self.root / "data" / "train.parquet"

    @property
    def val_file(self) -> Path:
        return self.root / "data" / "val.parquet"


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "verl-remote" / f"demo-v{DEMO_VERSION}"


def _corpus(rng: random.Random, lines: int) -> list[str]:
    words = DIGITS + FILLER + ["say", "user:", "assistant:"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(lines)]


def _make_tokenizer(path: Path, seed: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL)
    tokenizer.train_from_iterator(_corpus(random.Random(seed), 2000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<pad>",
        unk_token="<unk>",
        eos_token="<|im_end|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    # transformers 5 names its own fast-tokenizer class, which transformers 4 cannot import; the class both
    # know loads the same tokenizer.json with the same ids in either.
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2))


def _make_model(path: Path, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # Two query heads of 32 sharing one key/value head: the smallest head vLLM's CPU attention runs.
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)


def _make_lora_model(base: Path, path: Path, seed: int) -> None:
    """``base`` (the demo model) with an output matrix of its own, random, of standard deviation LORA_HEAD_STD."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig.from_pretrained(base)
    config.tie_word_embeddings = False
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(load_file(base / "model.safetensors"), strict=False)
    if list(missing) != ["lm_head.weight"] or unexpected:
        raise RuntimeError(f"the demo model's weights do not fit an untied copy: {missing=}, {unexpected=}")
    # A generator and seed of its own: the demo model's weights came from ``seed``'s, and the head must not repeat
    # them.
    head = torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        model.lm_head.weight.copy_(head * LORA_HEAD_STD)
    model.save_pretrained(path)
    for file in base.iterdir():  # the tokenizer and the generation config, as they are
        if file.name not in ("config.json", "model.safetensors"):
            shutil.copy2(file, path / file.name)


def _ensure_lora_model(assets: DemoAssets, seed: int) -> None:
    target = assets.lora_model_path
    if target.is_dir():
        return
    staging = Path(tempfile.mkdtemp(prefix=".staging-lora-model-", dir=assets.root))
    try:
        _make_lora_model(assets.model_path, staging, seed)
        try:
            os.replace(staging, target)
        except OSError:
            if not target.is_dir():  # else another process made it meanwhile
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _make_dataset(train: Path, val: Path, seed: int) -> None:
    import pandas as pd

    rng = random.Random(seed)

    def rows(count: int, split: str) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for index in range(count):
            digit = rng.choice(DIGITS)
            out.append(
                {
                    "data_source": DATA_SOURCE,
                    "prompt": [{"role": "user", "content": f"say {digit}"}],
                    "ability": "copy",
                    "reward_model": {"style": "rule", "ground_truth": digit},
                    "extra_info": {"split": split, "index": index},
                }
            )
        return out

    train.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows(512, "train")).to_parquet(train)
    pd.DataFrame(rows(32, "val")).to_parquet(val)


def demo_assets_made(cache_dir: Path | None = None) -> bool:
    """Whether :func:`ensure_demo_assets` has everything already (it would make nothing)."""
    assets = DemoAssets((cache_dir or default_cache_dir()).expanduser().resolve())
    return (assets.root / "COMPLETE").is_file() and assets.lora_model_path.is_dir()


def ensure_demo_assets(cache_dir: Path | None = None, seed: int = 0) -> DemoAssets:
    """Create the demo's tokenizer, models and data under ``cache_dir`` unless already there."""
    root = (cache_dir or default_cache_dir()).expanduser().resolve()
    assets = DemoAssets(root)
    if not (root / "COMPLETE").is_file():
        root.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=root.parent))
        try:
            staged = DemoAssets(staging)
            _make_tokenizer(staged.model_path, seed)
            _make_model(staged.model_path, seed)
            _make_dataset(staged.train_file, staged.val_file, seed)
            (staging / "COMPLETE").write_text(DEMO_VERSION)
            if root.exists():  # an incomplete earlier attempt
                shutil.rmtree(root)
            os.replace(staging, root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    _ensure_lora_model(assets, seed)
    return assets
