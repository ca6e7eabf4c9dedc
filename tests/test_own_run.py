"""A run of the user's own model, data and reward, made locally: verl's defaults for what the user does not set,
never the demo's.

The task (examples/own-task/make_task.py, what the user guide trains): a Qwen2-architecture model of random
weights with a byte-level BPE tokenizer and a ChatML chat template of its own, prompts of 100 to 300 tokens in
verl's RL format under a data_source of the test's own, and a reward file of the test's own that records every
call. It trains 2 steps on the local backend and, overlapped, on the Arctic test server (a process of its own,
as a service is). Mixed runs (the demo's inputs beside the user's) are refused in this process, before Ray.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import ROOT, arctic_process, free_port, last_line, left_behind, metric, python, run_log, steps, train

DATA_SOURCE = "tests/own_shaped"
#: What the user sets besides the model, data and reward: lengths, batch and learning rate as for a real model.
MAX_PROMPT, MAX_RESPONSE = 320, 40
SETTINGS = (
    f"data.max_prompt_length={MAX_PROMPT}",
    f"data.max_response_length={MAX_RESPONSE}",
    "data.train_batch_size=4",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.optim.lr=1e-4",
    "trainer.total_training_steps=2",
)
REWARD = '''\
"""The test's own reward: the share of the response's characters that are letters; every call recorded."""


def score_own_task(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    score = sum(c.isalpha() for c in solution_str) / max(1, len(solution_str))
    with open({log!r}, "a") as calls:
        calls.write(f"{{data_source}}\\t{{ground_truth}}\\t{{score!r}}\\t{{extra_info['index']}}\\n")
    return score
'''


def _make_task() -> ModuleType:
    spec = importlib.util.spec_from_file_location("own_task_make", ROOT / "examples" / "own-task" / "make_task.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class OwnTask:
    folder: Path

    @property
    def model(self) -> Path:
        return self.folder / "model"

    @property
    def train(self) -> Path:
        return self.folder / "data" / "train.parquet"

    @property
    def val(self) -> Path:
        return self.folder / "data" / "val.parquet"

    @property
    def reward(self) -> Path:
        return self.folder / "reward.py"

    @property
    def calls(self) -> Path:
        return self.folder / "reward-calls.tsv"

    def overrides(self) -> tuple[str, ...]:
        return (
            f"actor_rollout_ref.model.path={self.model}",
            f"data.train_files={self.train}",
            f"data.val_files={self.val}",
            f"reward.custom_reward_function.path={self.reward}",
            "reward.custom_reward_function.name=score_own_task",
            *SETTINGS,
        )

    def calls_made(self) -> list[tuple[str, str, float, int]]:
        if not self.calls.exists():
            return []
        rows = [line.split("\t") for line in self.calls.read_text().splitlines()]
        return [(source, truth, float(score), int(index)) for source, truth, score, index in rows]


@pytest.fixture(scope="module")
def own_task(tmp_path_factory: pytest.TempPathFactory) -> OwnTask:
    task = OwnTask(tmp_path_factory.mktemp("own-task"))
    make = _make_task()
    make.make_tokenizer(task.model, seed=3)
    make.make_model(task.model, seed=3)
    make.make_data(task.train.parent, seed=3, train=32, val=8, data_source=DATA_SOURCE)
    task.reward.write_text(REWARD.format(log=str(task.calls)))
    return task


def _prompt_lengths(task: OwnTask) -> list[int]:
    """Each training prompt's length in tokens, as verl makes it (the chat template applied)."""
    import pandas as pd
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(task.model)
    prompts = pd.read_parquet(task.train).prompt
    return [
        len(tokenizer.apply_chat_template(list(p), add_generation_prompt=True, tokenize=True)["input_ids"])
        for p in prompts
    ]


def test_the_composed_config_is_verls_defaults_with_the_users_lengths_and_reward(
    own_task: OwnTask, cli_main: Any
) -> None:
    import yaml

    code, out, err = cli_main("config", *own_task.overrides(), "--resolve")
    assert code == 0, err[-2000:]
    config = yaml.safe_load(out)
    rollout = config["actor_rollout_ref"]["rollout"]
    assert (rollout["prompt_length"], rollout["response_length"]) == (MAX_PROMPT, MAX_RESPONSE)
    assert config["reward"]["custom_reward_function"] == {"path": str(own_task.reward), "name": "score_own_task"}
    assert config["data"]["val_files"] == str(own_task.val)
    # verl's own defaults for what the user did not set, not the demo's.
    trainer = config["trainer"]
    assert (trainer["project_name"], trainer["experiment_name"], trainer["test_freq"]) == ("verl_examples", "gsm8k", -1)
    assert (trainer["total_epochs"], config["data"]["dataloader_num_workers"]) == (30, 8)
    assert "verl-remote://demo" not in out

    # The demo's settings are its own: with no model and no data it is the demo, the user's lengths taken.
    code, out, err = cli_main("config", "data.max_prompt_length=1024", "data.max_response_length=512", "--resolve")
    assert code == 0, err[-2000:]
    demo = yaml.safe_load(out)
    assert demo["actor_rollout_ref"]["model"]["path"] == "verl-remote://demo/model"
    assert (
        demo["actor_rollout_ref"]["rollout"]["prompt_length"],
        demo["actor_rollout_ref"]["rollout"]["response_length"],
    ) == (1024, 512)


def _mean(calls: list[tuple[str, str, float, int]]) -> float:
    return sum(score for _, _, score, _ in calls) / len(calls)


def _steps_of_groups(calls: list[tuple[str, str, float, int]], scores: list[float]) -> list[set[int]] | None:
    """Disjoint sets of 4 prompts (each scored 4 times), one per step, whose scores' mean is the step's mean; None
    when there are none."""
    groups: dict[int, list[tuple[str, str, float, int]]] = {}
    for call in calls:
        groups.setdefault(call[3], []).append(call)
    assert all(len(group) == 4 for group in groups.values()), groups

    def find(left: set[int], todo: list[float]) -> list[set[int]] | None:
        if not todo:
            return []
        for prompts in itertools.combinations(sorted(left), 4):
            if abs(_mean([c for p in prompts for c in groups[p]]) - todo[0]) < 1e-4:
                rest = find(left - set(prompts), todo[1:])
                if rest is not None:
                    return [set(prompts), *rest]
        return None

    return find(set(groups), scores)


def _assert_trained_the_users_task(
    task: OwnTask, out: Any, ckpt: Path, calls_before: int, *, overlapped: bool = False, trained: int = 2
) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert steps(out.stdout) == list(range(1, trained + 1))
    assert "preparing the demo" not in out.stdout and "verl-remote://demo" not in out.stdout + out.stderr
    log = run_log(ckpt)
    assert "verl-remote://demo" not in log and "/verl-remote/demo-v" not in log
    # The prompts reach the model whole (100 to 300 tokens, under data.max_prompt_length), the answers up to the
    # user's response length.
    lengths = _prompt_lengths(task)
    assert min(lengths) >= 100 and max(lengths) <= 300
    assert min(metric(log, "prompt_length/min")) >= min(lengths)
    assert max(metric(log, "prompt_length/max")) <= max(lengths)
    assert max(metric(log, "response_length/max")) > 8
    assert max(metric(log, "response_length/max")) <= MAX_RESPONSE
    # The user's reward function is the one verl called, for every response of every step, and its scores are the
    # ones the run trained on.
    # (An overlapped run samples one step ahead: the batch in flight at its end is scored too.)
    calls = task.calls_made()[calls_before:]
    assert len(calls) == trained * 4 * 4 or (overlapped and len(calls) == (trained + 1) * 4 * 4), len(calls)
    assert {source for source, *_ in calls} == {DATA_SOURCE}
    scores = metric(log, "critic/score/mean")
    if not overlapped:
        assert scores == pytest.approx([_mean(calls[:16]), _mean(calls[16:])], abs=1e-4)
    else:  # a step trains on the prompts' groups that finished first, of whichever batch: found by prompt
        assert _steps_of_groups(calls, scores) is not None, (scores, calls)
    assert min(metric(log, "actor/grad_norm")) > 0


@pytest.mark.train
def test_the_users_model_data_and_reward_train_on_the_local_backend(own_task: OwnTask, tmp_path: Path) -> None:
    before = len(own_task.calls_made())
    out = train(tmp_path, *own_task.overrides())
    _assert_trained_the_users_task(own_task, out, tmp_path / "ckpt", before)
    assert left_behind(tmp_path) == {}


@pytest.mark.train
def test_the_users_model_data_and_reward_train_on_the_arctic_test_server(own_task: OwnTask, tmp_path: Path) -> None:
    from verl_remote.testing.proxy import SLOW, Fault, FaultProxy

    port = free_port()
    before = len(own_task.calls_made())
    with arctic_process("main", tmp_path / "server.log", port=port), FaultProxy(f"http://127.0.0.1:{port}") as proxy:
        # A weight sync of a second, as a hosted service's: the next step's requests start while it runs.
        proxy.inject(Fault("/weight-sync", SLOW, times=10, delay_s=1.0))
        out = train(
            tmp_path,
            *own_task.overrides(),
            "remote_backend=arctic",
            f"remote_backend.comms.url={proxy.url}",
            # Overlapped, as a user with separate engines runs it: each next step sampled while this one trains.
            "trainer.v1.trainer_mode=remote_async",
            "remote_backend.colocate=false",
            "trainer.total_training_steps=3",  # step 3's samples are the first taken while a sync ran beside them
        )
    _assert_trained_the_users_task(own_task, out, tmp_path / "ckpt", before, overlapped=True, trained=3)
    assert "cannot sample while it trains" not in out.stdout + out.stderr
    # Step 1 on the initial weights' samples, step 2 on samples taken while step 1 trained, step 3 on samples
    # taken while step 2 trained, from step 1's weights: their requests, sent as step 1's sync ran beside step 2,
    # waited for it (one update old, not two: without the wait, trainer.v1.remote_async.background_weight_sync=true,
    # this reads [0, 1, 2]); the samples in flight at the end were awaited before the backend was destroyed.
    log = run_log(tmp_path / "ckpt")
    assert metric(log, "training/off_policy/trajectory_staleness/max") == [0, 1, 1]
    waited, took = metric(log, "timing_s/update_weights_wait"), metric(log, "timing_s/update_weights")
    assert len(waited) == 2 and len(took) == 2, (waited, took)  # the syncs after steps 1 and 2, each beside a step
    assert "still in flight" not in out.stdout + out.stderr
    assert left_behind(tmp_path) == {}


# -- mixed runs and missing rewards: refused before Ray, naming the key to set ------------------------------------


@pytest.fixture
def demo_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A demo cache of this test's own (nothing of the demo is made by a refused run)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _refusals(task: OwnTask, tmp_path: Path) -> Iterator[tuple[list[str], str]]:
    model, train_files, val_files = (
        f"actor_rollout_ref.model.path={task.model}",
        f"data.train_files={task.train}",
        f"data.val_files={task.val}",
    )
    reward = [f"reward.custom_reward_function.path={task.reward}", "reward.custom_reward_function.name=score_own_task"]
    yield (
        [model, train_files, val_files],
        f"data.train_files={task.train}: no reward is set and verl has none for data_source '{DATA_SOURCE}': set "
        "reward.custom_reward_function.path=<your reward .py file> and reward.custom_reward_function.name=",
    )
    yield (
        [model, train_files, val_files, "reward.custom_reward_function.path=verl-remote://demo/reward.py"],
        "reward.custom_reward_function.path=verl-remote://demo/reward.py is the demo's reward, which scores only the "
        f"demo's task (data_source 'verl_remote/say_digit'), but data.train_files={task.train} (data_source "
        f"'{DATA_SOURCE}') is another task: set reward.custom_reward_function.path",
    )
    yield (
        [model, train_files, "data.val_files=verl-remote://demo/val.parquet", *reward],
        "data.val_files=verl-remote://demo/val.parquet is the demo's validation set, but data.train_files="
        f"{task.train} (data_source '{DATA_SOURCE}') is data of your own: set data.val_files",
    )
    yield (
        ["--recipe", "demo", train_files, val_files, *reward],
        "actor_rollout_ref.model.path=verl-remote://demo/model is the demo's model, whose tokenizer knows only the "
        f"demo's words, but data.train_files={task.train} (data_source '{DATA_SOURCE}') is data of your own: set "
        "actor_rollout_ref.model.path to your model",
    )
    yield (
        [model, train_files],
        "data.val_files is not set, and verl's default ~/data/rlhf/gsm8k/test.parquet is not there: set data.val_files",
    )
    yield (
        [model, train_files, val_files, *reward],
        f"data.train_batch_size=1024: data.train_files={task.train} has 32 rows, fewer than one step's prompts, so no "
        "step would run (verl drops an incomplete batch); set data.train_batch_size to 32 or less",
    )
    yield (
        [model, train_files, val_files, reward[0], "reward.custom_reward_function.name=compute_score"],
        f"reward.custom_reward_function.name=compute_score: {task.reward} has no 'compute_score' (it defines "
        "score_own_task); set reward.custom_reward_function.name",
    )
    latin = tmp_path / "latin1_reward.py"  # saved by an editor in Latin-1: a traceback before
    latin.write_bytes(b"def score_own_task(*args, **kwargs):\n    return len('caf\xe9')\n")
    yield (
        [model, train_files, val_files, f"reward.custom_reward_function.path={latin}", reward[1]],
        f"reward.custom_reward_function.path={latin}, line 2: not UTF-8 (",
    )
    import pandas as pd

    empty = tmp_path / "empty.parquet"  # the columns verl needs, and no row
    pd.read_parquet(task.train).iloc[:0].to_parquet(empty)
    yield (
        [model, f"data.train_files={empty}", val_files, *reward],
        f"data.train_files={empty}: no rows, nothing to train on; point it at your data set",
    )
    flat = tmp_path / "flat.parquet"
    pd.DataFrame({"prompt": ["a question"], "data_source": [DATA_SOURCE], "answer": ["x"]}).to_parquet(flat)
    yield (
        [model, f"data.train_files={flat}", val_files, *reward],
        f"data.train_files={flat}: no column 'reward_model' (it has prompt, data_source, answer); verl's RL data needs",
    )
    pd.DataFrame(
        {"prompt": ["a question"], "data_source": [DATA_SOURCE], "reward_model": [{"ground_truth": "x"}]}
    ).to_parquet(flat)
    yield (
        [model, f"data.train_files={flat}", val_files, *reward],
        f"data.train_files={flat}: column 'prompt' holds plain text, not chat messages",
    )


@pytest.mark.faults
def test_mixed_runs_and_data_without_a_reward_are_refused_before_ray_naming_the_key(
    own_task: OwnTask, tmp_path: Path, demo_cache: Path, cli_main: Any
) -> None:
    for argv, message in _refusals(own_task, tmp_path):
        code, _out, err = cli_main("train", *argv)
        assert code == 2, (argv, err[-2000:])
        assert message in last_line(err), (argv, last_line(err))
        assert "Traceback" not in err
    assert not demo_cache.exists()  # the demo's files were not made for any of them


@pytest.mark.faults
def test_a_recipe_from_the_demo_with_the_users_own_data_is_refused_naming_the_demo(
    own_task: OwnTask, tmp_path: Path, demo_cache: Path, cli_main: Any
) -> None:
    """A shipped recipe starts from the demo's settings: with the user's own model, data and reward it gave 16-token
    prompts, 8-token answers, lr 0.005 and 40 steps without a word (config --resolve and train alike)."""
    own = [
        f"actor_rollout_ref.model.path={own_task.model}",
        f"data.train_files={own_task.train}",
        f"data.val_files={own_task.val}",
        f"reward.custom_reward_function.path={own_task.reward}",
        "reward.custom_reward_function.name=score_own_task",
    ]
    recipe = ROOT / "configs" / "grpo-kl.yaml"
    expected = (
        f"recipe {recipe} starts from the demo's settings (verl_remote_demo: data.max_prompt_length=16, "
        "data.max_response_length=8, actor_rollout_ref.actor.optim.lr=0.005, trainer.total_training_steps=40), made "
        f"for the demo's tiny model, but data.train_files={own_task.train} is data of your own: start the recipe "
        "from verl_remote, verl's defaults (defaults: [verl_remote, _self_]), and set what your run needs "
        "(configs/README.md)"
    )
    for verb in (("config", "--resolve"), ("train",)):
        code, _out, err = cli_main(*verb, "--recipe", str(recipe), *own)
        assert code == 2, err[-2000:]
        assert last_line(err).endswith(expected), last_line(err)
    code, _out, err = cli_main("config", "--recipe", "demo", *own)
    assert code == 2 and "--recipe demo starts from the demo's settings" in last_line(err)
    # The same recipe from verl_remote: verl's defaults, and the run's own settings.
    mine = tmp_path / "mine.yaml"
    mine.write_text(recipe.read_text().replace("- verl_remote_demo ", "- verl_remote "))
    code, out, err = cli_main("config", "--recipe", str(mine), *own)
    assert code == 0, err[-2000:]
    assert "max_prompt_length: 512" in out and "use_kl_loss: true" in out
    assert not demo_cache.exists()


@pytest.mark.faults
def test_the_users_model_on_the_demos_task_is_a_mix_said_in_one_line(
    own_task: OwnTask, tmp_path: Path, cli_main: Any
) -> None:
    from verl_remote.cli.inputs import check_inputs
    from verl_remote.discovery.compose import compose_config

    config = compose_config([f"actor_rollout_ref.model.path={own_task.model}"], recipe="demo")
    assert check_inputs(config) == ["the demo's data, validation set and reward with your model"]
    assert check_inputs(compose_config([], recipe="demo")) == []


@pytest.mark.faults
def test_a_refusal_of_the_users_inputs_imports_neither_verl_nor_torch(own_task: OwnTask) -> None:
    argv = ["train", f"actor_rollout_ref.model.path={own_task.model}", f"data.train_files={own_task.train}"]
    argv.append(f"data.val_files={own_task.val}")
    code = (
        "import sys\n"
        "from verl_remote.cli import main as cli\n"
        f"assert cli.main({argv!r}) == 2\n"
        "print(sorted(m for m in ('verl', 'torch', 'ray') if m in sys.modules))\n"
    )
    out = python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "no reward is set and verl has none for data_source" in out.stderr
