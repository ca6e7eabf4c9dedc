"""Make a small task of your own shape, locally: a model, its tokenizer and a data set in verl's RL format.

    python examples/own-task/make_task.py --out own-task

writes

- ``own-task/model``: a Qwen2-architecture causal LM with random weights (a stand-in for your model: about 0.5M
  parameters) and a byte-level BPE tokenizer of its own with a ChatML chat template, as Qwen's models have;
- ``own-task/data/train.parquet`` and ``val.parquet``: prompts of 100 to 300 tokens in verl's RL format (the
  columns ``data_source``, ``prompt``, ``ability``, ``reward_model``, ``extra_info``), for the "key word" task:
  a passage of words hides one key word, and the answer is that word. ``reward.py`` beside this file scores it.

Nothing is downloaded. docs/user-guide.md ("Your model, your data, your reward") trains it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

DATA_SOURCE = "own_task/key_word"
# The task's vocabulary: the words a passage is made of.
WORDS = (  # noqa: SIM905 - a sentence reads better than a list of 56 strings
    "river stone cloud lamp garden window bread paper mirror candle forest ladder pocket silver winter basket "
    "hammer orange planet rocket saddle tunnel violin wallet yellow zebra anchor bottle castle dragon engine "
    "feather guitar island jacket kettle lemon magnet needle ocean pencil quilt rabbit spoon tiger umbrella "
    "valley wagon sunset market harbor meadow pillow marble copper thunder"
).split()
FILLER = "the a of and to in is was on with for as at by it from that this near under over".split()  # noqa: SIM905
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def passage(rng: random.Random, words: int) -> tuple[str, str]:
    """A passage of ``words`` words hiding a key word; (the prompt's text, the key word)."""
    key = rng.choice(WORDS)
    text = [rng.choice(WORDS if rng.random() < 0.6 else FILLER) for _ in range(words)]
    text.insert(rng.randrange(len(text)), f"(the key word is {key})")
    return " ".join(text) + ". What is the key word? Answer with the key word only.", key


def make_tokenizer(path: Path, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [passage(rng, rng.randint(20, 80))[0] for _ in range(2000)]
    corpus += ["user", "assistant", "system", "\n"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_file.write_text(json.dumps(config, indent=2))


def make_model(path: Path, seed: int) -> None:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(path)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)


def make_data(folder: Path, seed: int, train: int, val: int, data_source: str = DATA_SOURCE) -> None:
    import pandas as pd

    rng = random.Random(seed + 1)

    def rows(count: int, split: str) -> list[dict[str, object]]:
        out: list[dict[str, object]] = []
        for index in range(count):
            text, key = passage(rng, rng.randint(70, 200))
            out.append(
                {
                    "data_source": data_source,
                    "prompt": [{"role": "user", "content": text}],
                    "ability": "reading",
                    "reward_model": {"style": "rule", "ground_truth": key},
                    "extra_info": {"split": split, "index": index},
                }
            )
        return out

    folder.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows(train, "train")).to_parquet(folder / "train.parquet")
    pd.DataFrame(rows(val, "val")).to_parquet(folder / "val.parquet")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the folder to write (model/ and data/)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train-size", type=int, default=256)
    parser.add_argument("--val-size", type=int, default=16)
    args = parser.parse_args()
    model = args.out / "model"
    make_tokenizer(model, args.seed)
    make_model(model, args.seed)
    make_data(args.out / "data", args.seed, args.train_size, args.val_size)
    print(f"made {model} and {args.out / 'data'}/{{train,val}}.parquet")


if __name__ == "__main__":
    main()
