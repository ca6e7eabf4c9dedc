"""Config composition through the CLI and through verl's own main_ppo entry point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import ROOT, last_line
from verl_remote import BackendNotFoundError, DuplicateBackendError
from verl_remote.discovery.compose import ConfigError, compose_config


def test_defaults_are_verls_ppo_trainer_with_the_local_backend_and_the_demo_is_a_recipe() -> None:
    config = compose_config()
    assert config.remote_backend.name == "local"
    assert config.trainer.v1.trainer_mode == "remote"
    assert config.actor_rollout_ref.rollout.name == "verl_remote"
    assert config.trainer.use_v1 is True
    assert config.actor_rollout_ref.rollout.mode == "async"
    # verl's own defaults for the model, the data, the reward and the lengths; the rollout's follow the data's.
    assert config.actor_rollout_ref.model.path == "~/models/deepseek-llm-7b-chat"
    assert config.data.train_files == "~/data/rlhf/gsm8k/train.parquet"
    assert config.reward.custom_reward_function.path is None
    assert config.actor_rollout_ref.actor.optim.lr == 1e-6
    assert (config.data.train_batch_size, config.trainer.total_training_steps) == (1024, None)
    OmegaConf.resolve(config)
    assert (config.actor_rollout_ref.rollout.prompt_length, config.actor_rollout_ref.rollout.response_length) == (
        512,
        512,
    )

    demo = compose_config(recipe="demo")
    assert demo.actor_rollout_ref.model.path == "verl-remote://demo/model"
    assert demo.reward.custom_reward_function.path == "verl-remote://demo/reward.py"
    assert (demo.data.max_prompt_length, demo.data.max_response_length, demo.trainer.total_training_steps) == (
        16,
        8,
        40,
    )


@pytest.mark.parametrize(
    ("overrides", "recipe"),
    [
        ([], "demo"),
        (["trainer.total_training_steps=5", "remote_backend=arctic"], "demo"),
        (["actor_rollout_ref.model.path=verl-remote://demo/lora-model"], "demo"),
        (["data.train_files=[verl-remote://demo/train.parquet]"], "demo"),
        (["actor_rollout_ref.model.path=/models/mine"], None),
        (["data.train_files=/data/train.parquet"], None),
        (["data.val_files=/data/val.parquet"], None),
        (["+data.train_files=/data/train.parquet"], None),
        (["data.train_files=[verl-remote://demo/train.parquet,/data/more.parquet]"], None),
    ],
)
def test_a_command_is_the_demo_when_it_names_no_model_and_no_data_of_its_own(
    overrides: list[str], recipe: str | None
) -> None:
    from verl_remote.demo import recipe_for

    assert recipe_for(overrides, None) == recipe
    assert recipe_for(overrides, "configs/mine.yaml") == "configs/mine.yaml"  # a recipe decides for itself


def test_the_demos_files_where_they_are_made_count_as_the_demos() -> None:
    """verl-remote's own commands print the demo's assets as the files they are made into (the Tinker local
    server's ready line, `config --overrides`): those name the demo's inputs too."""
    from verl_remote.demo import is_demo_value, reward
    from verl_remote.demo.assets import default_cache_dir

    model = default_cache_dir() / "lora-model"
    assert is_demo_value(str(model)) and is_demo_value(f"file://{model}")
    assert is_demo_value(reward.__file__)
    assert not is_demo_value(str(default_cache_dir().parent / "another")) and not is_demo_value("Qwen/Qwen3-8B")


def test_remote_backend_selects_the_group_without_plus_and_takes_verl_overrides() -> None:
    config = compose_config(["remote_backend=echo", "remote_backend.state_dir=/tmp/x", "algorithm.adv_estimator=grpo"])
    assert dict(config.remote_backend) == {"name": "echo", "state_dir": "/tmp/x"}
    assert config.algorithm.adv_estimator == "grpo"


@pytest.mark.faults
@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        (["remote_backend=ecoh"], BackendNotFoundError, "backend 'ecoh' is not installed; installed: "),
        (["remote_backend=twin"], DuplicateBackendError, "registered by 2 distributions"),
        (["trainer.no_such_key=1"], ConfigError, "unknown key trainer.no_such_key: neither verl's config nor"),
        (["algorithm.adv_estimator"], ConfigError, "Error parsing override 'algorithm.adv_estimator'"),
        (
            ["remote_backend=echo", "remote_backend.no_such_key=1"],
            ConfigError,
            "unknown key remote_backend.no_such_key: neither",
        ),
        (
            ["remote_backend=arctic", "remote_backend.url=http://10.0.0.5:7000"],
            ConfigError,
            r"^unknown key remote_backend.url; did you mean remote_backend.comms.url\?$",
        ),
        (["trainer.total_training_step=3"], ConfigError, "did you mean trainer.total_training_steps\\?$"),
        (["trainr.total_epochs=3"], ConfigError, "did you mean trainer.total_epochs\\?$"),
        (["actor_rollout_ref.actor.optim.lrr=3"], ConfigError, "did you mean actor_rollout_ref.actor.optim.lr\\?$"),
    ],
)
def test_bad_overrides_raise_errors_the_user_can_act_on(
    overrides: list[str], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        compose_config(overrides)


@pytest.mark.faults
def test_cli_config_prints_yaml_and_rejects_bad_input_with_exit_2(cli_main: Any) -> None:
    code, stdout, stderr = cli_main("config", "remote_backend=echo", "algorithm.adv_estimator=grpo")
    assert code == 0, stderr
    printed = yaml.safe_load(stdout)
    assert printed["remote_backend"] == {"name": "echo", "state_dir": None}
    assert printed["algorithm"]["adv_estimator"] == "grpo"

    code, stdout, stderr = cli_main("config", "remote_backend=arcitc")
    assert code == 2
    assert stdout == ""
    assert "verl-remote config: error: backend 'arcitc' is not installed; installed: " in stderr
    assert "echo (verl-remote-echo-backend 0.1.0)" in stderr
    assert "Traceback" not in stderr

    code, _stdout, stderr = cli_main("config", "trainer.no_such_key=1")
    assert code == 2
    assert "verl-remote config: invalid config: unknown key trainer.no_such_key: " in stderr
    assert "Traceback" not in stderr


def test_a_recipe_composes_and_command_line_overrides_win(tmp_path: Path, cli_main: Any) -> None:
    recipe = ROOT / "configs" / "grpo-kl.yaml"
    config = compose_config(["actor_rollout_ref.actor.kl_loss_coef=0.5"], recipe=recipe)
    assert config.actor_rollout_ref.actor.use_kl_loss is True
    assert config.actor_rollout_ref.actor.kl_loss_coef == 0.5
    assert config.remote_backend.name == "local"
    arctic = compose_config([], recipe=ROOT / "configs" / "arctic-test-server.yaml")
    assert arctic.remote_backend.name == "arctic"
    assert arctic.remote_backend.comms.launch.startswith("python -m verl_arctic.testing.server --port 7000")

    # A recipe may choose the backend itself.
    chooser = tmp_path / "uses_echo.yaml"
    chooser.write_text("defaults:\n  - verl_remote\n  - override remote_backend: echo\n  - _self_\n")
    assert compose_config([], recipe=chooser).remote_backend.name == "echo"

    with pytest.raises(ConfigError, match="does not exist"):
        compose_config([], recipe=tmp_path / "missing.yaml")
    code, _stdout, stderr = cli_main("config", "--recipe", str(tmp_path / "missing.yaml"))
    assert code == 2
    assert "recipe" in stderr and "does not exist" in stderr


@pytest.mark.faults
def test_a_group_file_planted_beside_a_recipe_does_not_replace_the_installed_one(tmp_path: Path) -> None:
    """A recipe is one file: its folder is not searched, so a shared folder's remote_backend/arctic.yaml (with a
    launch: command of its own) cannot stand in for the installed group of a recipe that chooses arctic."""
    shared = tmp_path / "shared"
    (shared / "remote_backend").mkdir(parents=True)
    (shared / "remote_backend" / "arctic.yaml").write_text("name: arctic\ncomms:\n  launch: sh -c planted\n")
    (shared / "verl_remote.yaml").write_text("trainer:\n  total_training_steps: 666\n")  # nor verl-remote's config
    recipe = shared / "mine.yaml"
    recipe.write_text("defaults:\n  - verl_remote\n  - override remote_backend: arctic\n  - _self_\n")
    config = compose_config([], recipe=recipe)
    assert config.remote_backend.comms.launch is None  # the installed group's default
    assert config.remote_backend.training_gpus == 1 and config.trainer.total_training_steps != 666
    assert sorted(p.name for p in shared.iterdir()) == ["mine.yaml", "remote_backend", "verl_remote.yaml"]


@pytest.mark.faults
def test_a_malformed_recipe_is_named_with_its_line_not_a_parser_traceback(tmp_path: Path, cli_main: Any) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("defaults:\n  - verl_remote\n  bad: [\n")
    code, _stdout, stderr = cli_main("train", "--recipe", str(recipe))
    assert code == 2
    assert stderr.strip().splitlines()[-1] == (
        f"verl-remote train: invalid config: recipe {recipe}, line 3, column 3: not valid YAML: "
        "while parsing a block collection expected <block end>, but found '?'"
    )
    assert "Traceback" not in stderr
    recipe.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping of config keys, not a list"):
        compose_config([], recipe=recipe)


@pytest.mark.faults
def test_a_recipe_named_as_a_config_or_pulling_in_a_file_beside_it_is_said_in_its_own_terms(
    tmp_path: Path, cli_main: Any
) -> None:
    """A recipe called verl_remote.yaml included itself (a RecursionError); one whose defaults name a file beside it
    failed in Hydra's words, naming the temporary folder it was composed from."""
    named = tmp_path / "verl_remote.yaml"
    named.write_text("defaults:\n  - verl_remote\n  - _self_\ntrainer:\n  total_training_steps: 7\n")
    assert compose_config([], recipe=named).trainer.total_training_steps == 7
    beside = tmp_path / "mine.yaml"
    beside.write_text("defaults:\n  - verl_remote\n  - common\n  - _self_\n")
    (tmp_path / "common.yaml").write_text("trainer:\n  total_training_steps: 9\n")
    code, _stdout, stderr = cli_main("config", "--recipe", str(beside))
    assert code == 2
    assert last_line(stderr) == (
        f"verl-remote config: invalid config: recipe {beside}: its defaults list names 'common', a file beside it; a "
        "recipe is read alone (a file beside it in a shared folder must not change a run): copy the keys of "
        "common.yaml into the recipe"
    )
    (tmp_path / "common.yaml").unlink()  # nowhere: Hydra's words, with the recipe's own path
    code, _stdout, stderr = cli_main("config", "--recipe", str(beside))
    assert code == 2 and "Traceback" not in stderr
    assert last_line(stderr).startswith(
        f"verl-remote config: invalid config: recipe {beside}: its defaults list names 'common', a config neither "
    )
    assert "verl-remote-recipe-" not in stderr and "verl_remote_user_recipe" not in stderr


def test_a_group_file_must_name_its_backend(tmp_path: Path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("defaults:\n  - verl_remote\n  - _self_\n")
    # The broken distribution ships remote_backend/other.yaml with 'name: other' but no backend 'other'.
    with pytest.raises(BackendNotFoundError, match="backend 'other' is not installed"):
        compose_config(["remote_backend=other"], recipe=recipe)


@pytest.mark.parametrize(
    ("value", "word"),
    [
        (None, "null"),
        (True, "true"),
        (8, "8"),
        (0.005, "0.005"),
        ("grpo", "grpo"),
        ("/models/x-1.5b", "/models/x-1.5b"),
        ("8", "'8'"),  # a string that Hydra would read as a number stays a string
        ("true", "'true'"),
        ("a,b", "'a,b'"),
        ("${oc.env:HOME}", "${oc.env:HOME}"),
        (["console", "file"], "[console,file]"),
        ({}, "{}"),
    ],
)
def test_settings_print_as_hydra_override_words(value: object, word: str) -> None:
    from verl_remote.discovery.compose import _override_value

    assert _override_value(value, "k") == word


def test_a_value_with_spaces_cannot_be_one_override_word() -> None:
    from verl_remote.discovery.compose import _override_value

    with pytest.raises(ConfigError, match="k='a b': a value with spaces cannot be printed as one override word"):
        _override_value("a b", "k")


def test_the_paths_every_cluster_node_must_see_are_the_local_ones_verl_opens(tmp_path: Path) -> None:
    from verl_remote.runtime.cluster import SharedPath, shared_paths

    model = tmp_path / "model"
    model.mkdir()
    config = compose_config(
        [
            "data.train_files=[/data/a.parquet,hdfs://cluster/b.parquet]",
            "data.val_files=/data/val.parquet",
            f"actor_rollout_ref.model.path={model}",
            "reward.custom_reward_function.path=/code/reward.py",
            "trainer.default_local_dir=/shared/run",
        ]
    )
    assert shared_paths(config, ".verl-remote.lock") == [
        SharedPath("data.train_files", "/data/a.parquet", "file"),
        SharedPath("data.val_files", "/data/val.parquet", "file"),
        SharedPath("actor_rollout_ref.model.path", str(model), "dir"),
        SharedPath("reward.custom_reward_function.path", "/code/reward.py", "file"),
        SharedPath("trainer.default_local_dir", "/shared/run/.verl-remote.lock", "run-folder"),
    ]
