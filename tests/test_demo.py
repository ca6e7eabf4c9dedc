"""The built-in demo's assets: the model for LoRA services beside the demo's own, and what an adapter on attention
and MLP can reach on each (verl_remote.demo.reach; benchmarks/lora_reach.py prints it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import ROOT
from verl_remote.demo import resolve_demo_assets
from verl_remote.demo.assets import LORA_HEAD_STD, ensure_demo_assets
from verl_remote.demo.reach import lora_reach
from verl_remote.discovery.compose import compose_config

#: What the Tinker recipe must end at (docs/measurements.md, the Tinker backend).
TARGET = 0.25


def test_the_lora_model_is_the_demo_model_with_an_output_matrix_of_its_own(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    assets = ensure_demo_assets()
    base, lora = assets.model_path, assets.lora_model_path
    assert '"tie_word_embeddings": true' in (base / "config.json").read_text()
    assert '"tie_word_embeddings": false' in (lora / "config.json").read_text()
    base_weights = load_file(base / "model.safetensors")
    lora_weights = load_file(lora / "model.safetensors")
    assert set(lora_weights) - set(base_weights) == {"lm_head.weight"}
    assert all(torch.equal(base_weights[name], lora_weights[name]) for name in base_weights)
    assert float(lora_weights["lm_head.weight"].std()) == pytest.approx(LORA_HEAD_STD, rel=0.1)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (lora / name).read_bytes() == (base / name).read_bytes(), name

    # A cache made before the LoRA model existed gets it beside its files, the same bytes, the others untouched.
    older = tmp_path / "demo"
    shutil.copytree(assets.root, older, ignore=shutil.ignore_patterns("lora-model", ".staging-*"))
    made = ensure_demo_assets(older)
    assert sorted(p.name for p in older.iterdir()) == ["COMPLETE", "data", "lora-model", "model"]
    for name in ("config.json", "model.safetensors"):
        assert (made.lora_model_path / name).read_bytes() == (lora / name).read_bytes(), name
        assert (made.model_path / name).read_bytes() == (base / name).read_bytes(), name

    # The Tinker recipe trains it (the local server serves it by default).
    config = compose_config([], recipe=ROOT / "configs" / "tinker-local-server.yaml")
    assert config.remote_backend.name == "tinker"
    assert config.actor_rollout_ref.model.path == "verl-remote://demo/lora-model"
    resolve_demo_assets(config)
    assert config.actor_rollout_ref.model.path == str(lora)


def test_a_lora_on_attention_and_mlp_reaches_the_target_on_the_lora_model_not_on_the_demo_model() -> None:
    assets = ensure_demo_assets()
    tied = lora_reach(assets.model_path)
    untied = lora_reach(assets.lora_model_path)
    assert tied.tied and not untied.tied
    # docs/tinker-backend.md quotes these.
    assert tied.max_logit == pytest.approx(1.570, abs=1e-3)
    assert tied.max_probability == pytest.approx(0.2442, abs=1e-4)
    assert tied.best_reward == pytest.approx(0.2212, abs=1e-4)
    assert max(tied.best_reward_per_digit.values()) < TARGET
    assert untied.max_logit == pytest.approx(7.534, abs=1e-3)
    assert untied.max_probability > 0.998
    assert untied.best_reward == pytest.approx(0.9692, abs=1e-4)
    assert min(untied.best_reward_per_digit.values()) > 0.9

    # A maximum, not a point where the search happened to stop: other random starts end at the same value.
    again = lora_reach(assets.model_path, seed=1, starts=4)
    for digit, best in tied.best_reward_per_digit.items():
        assert again.best_reward_per_digit[digit] == pytest.approx(best, abs=1e-9)


def test_preparing_the_demo_is_said_only_when_something_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for made in (True, False):
        config = compose_config([], recipe="demo")
        resolve_demo_assets(config)
        said = "preparing the demo's model, tokenizer and data" in capsys.readouterr().out
        assert said is made
        assert Path(config.actor_rollout_ref.model.path).is_relative_to(tmp_path)
