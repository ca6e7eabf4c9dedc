"""verl-remote-tinker's mapping of verl's settings and loss onto the Tinker API, without a service.

The gradient the service applies is checked against the real SkyRL server in test_tinker_server.py; here,
the arithmetic of what is sent, the settings refused, and the optimizer and schedule mapping.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
import tomllib
import torch
from omegaconf import OmegaConf

from conftest import ROOT
from verl_remote.discovery.compose import compose_config
from verl_remote.kit.compute import actor_loss
from verl_remote.runtime.summary import RunSummary
from verl_remote_tinker.backend import TinkerBackend, check_objective, loss_reduction
from verl_remote_tinker.session import SDK_RANGE, WaitClock, adam_params, lr_schedule
from verl_remote_tinker.worker import linearised_datums


def _jagged(rows: list[list[float]], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r, dtype=dtype) for r in rows], layout=torch.jagged)


def _mini_batch() -> tuple[list[list[int]], dict[str, Any], list[np.ndarray]]:
    """Two rows (prompt 3 + response 2, prompt 2 + response 3), verl's fields, the service's log-probs."""
    rows = [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12]]
    current = [np.array([-1.0, -2.0, -1.5, -0.5], np.float32), np.array([-1.2, -0.7, -2.2, -0.3], np.float32)]
    batch = {
        "input_ids": _jagged([[float(t) for t in r] for r in rows]).to(torch.long),
        "prompts": _jagged([[5, 6, 7], [5, 6]]).to(torch.long),
        "responses": _jagged([[8, 9], [10, 11, 12]]).to(torch.long),
        "response_mask": _jagged([[1, 1], [1, 1, 1]]),
        "old_log_probs": _jagged([[-1.6, -0.4], [-0.6, -2.0, -0.3]]),
        "advantages": _jagged([[1.0, 1.0], [-0.5, -0.5, -0.5]]),
    }
    return rows, batch, current


def _actor(*overrides: str) -> Any:
    """verl's composed actor config (the run's), with overrides."""
    return compose_config(
        ["actor_rollout_ref.actor.ppo_mini_batch_size=2", *overrides], recipe="demo"
    ).actor_rollout_ref.actor


def _grad(rows: list[list[int]], batch: dict[str, Any], current: list[np.ndarray], actor: Any) -> np.ndarray:
    leaf = torch.tensor(np.concatenate([np.append(v, 0.0) for v in current]), dtype=torch.float32, requires_grad=True)
    log_probs = torch.nested.nested_tensor_from_jagged(leaf, batch["input_ids"].offsets())
    meta = {"dp_size": 1, "batch_num_tokens": 5, "global_batch_size": 2}
    loss, _ = actor_loss(log_probs, batch, meta, actor)
    loss.backward()
    assert leaf.grad is not None
    return leaf.grad.numpy()


def _surrogate_gradient(datums: list[dict[str, Any]], reduction: str) -> list[np.ndarray]:
    """d(service loss)/d(target log-prob) for the importance_sampling loss at ratio 1, as the service reduces it.

    sum: Tinker's documented ``-(ratio * advantages).sum()``. sequence_mean: SkyRL's JAX backend
    (skyrl/tinker/loss_fns.py importance_sampling_loss; skyrl/backends/jax.py loss_for_lora divides each
    sequence by its weights' sum, AccumulatedGradients.get_mean by the number of sequences).
    """
    out = []
    for d in datums:
        per_token = -np.asarray(d["advantages"]) * np.asarray(d["weights"] if reduction != "sum" else 1.0)
        if reduction == "sequence_mean":
            per_token = per_token / max(float(np.sum(d["weights"])), 1e-9) / len(datums)
        out.append(per_token)
    return out


@pytest.mark.parametrize("reduction", ["sum", "sequence_mean"])
@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",),
        (
            "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum",
            "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        ),
        ("actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1"),
    ],
    ids=["vanilla-token-mean", "seq-mean-token-mean", "gspo", "kl"],
)
def test_the_service_gets_verls_gradient_whatever_its_reduction(overrides: tuple[str, ...], reduction: str) -> None:
    actor = _actor(*overrides)
    rows, batch, current = _mini_batch()
    if actor.use_kl_loss:
        batch["ref_log_prob"] = _jagged([[-1.4, -0.6], [-0.8, -1.8, -0.2]])
    grad = _grad(rows, batch, current, actor)
    datums = linearised_datums(rows, current, grad, batch["response_mask"], reduction)
    applied = _surrogate_gradient(datums, reduction)
    start = 0
    for row, d, got in zip(rows, datums, applied, strict=True):
        n = len(row)
        want = grad[start : start + n - 1]  # dL/dl at each target position; the last position predicts nothing
        start += n
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        assert d["input"] == row[:-1] and d["target"] == row[1:]
        assert len(d["logprobs"]) == len(d["weights"]) == len(d["advantages"]) == n - 1
    assert any(np.abs(a).max() > 0 for a in applied)  # a gradient to send, not zeros


def test_prompt_tokens_carry_no_weight_and_masked_response_tokens_none() -> None:
    rows, batch, current = _mini_batch()
    batch["response_mask"] = _jagged([[1, 0], [1, 1, 1]])
    grad = _grad(rows, batch, current, _actor())
    datums = linearised_datums(rows, current, grad, batch["response_mask"], "sequence_mean")
    assert datums[0]["weights"] == [0.0, 0.0, 1.0, 0.0]
    assert datums[0]["advantages"][:2] == [0.0, 0.0] and datums[0]["advantages"][3] == 0.0
    assert datums[1]["weights"] == [0.0, 1.0, 1.0, 1.0]


@pytest.mark.faults
@pytest.mark.parametrize(
    ("actor", "rollout", "message"),
    [
        ({"entropy_coeff": 0.01}, {}, "actor_rollout_ref.actor.entropy_coeff=0.01"),
        ({}, {"temperature": 0.7}, "actor_rollout_ref.rollout.temperature=0.7"),
        ({"optim": {"optimizer": "SGD"}}, {}, "actor_rollout_ref.actor.optim.optimizer=SGD"),
    ],
)
def test_settings_a_tinker_service_cannot_honour_are_refused(
    actor: dict[str, Any], rollout: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_objective(actor, rollout)


def test_the_objectives_it_can_compute_pass() -> None:
    check_objective({"entropy_coeff": 0.0, "use_kl_loss": True, "optim": {"optimizer": "AdamW"}}, {"temperature": 1})


def test_verls_adamw_settings_become_adam_params() -> None:
    optim = {"lr": 1e-5, "betas": [0.9, 0.98], "weight_decay": 0.1, "clip_grad": 0.5}
    assert adam_params(optim) == {
        "beta1": 0.9,
        "beta2": 0.98,
        "eps": 1e-8,
        "weight_decay": 0.1,
        "grad_clip_norm": 0.5,
    }
    assert adam_params({**optim, "override_optimizer_config": {"eps": 1e-6}})["eps"] == 1e-6


@pytest.mark.parametrize("kind", ["constant", "cosine"])
def test_the_learning_rate_follows_verls_own_schedule(kind: str) -> None:
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    optim = {"lr": 1e-3, "lr_scheduler_type": kind, "lr_warmup_steps": 3, "total_training_steps": 10}
    ours = lr_schedule(optim)
    model = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=1e-3)
    model.step()
    if kind == "cosine":
        theirs = get_cosine_schedule_with_warmup(model, num_warmup_steps=3, num_training_steps=10)
    else:
        theirs = get_constant_schedule_with_warmup(model, num_warmup_steps=3)
    seen = []
    for _ in range(10):
        assert ours.get_last_lr() == theirs.get_last_lr()
        seen.append(ours.get_last_lr()[0])
        ours.step()
        theirs.step()
    assert seen[0] < seen[3]  # the warmup is there


def test_loss_reduction_takes_an_explicit_value_and_refuses_others() -> None:
    assert loss_reduction({"loss_reduction": "sum", "base_url": "http://127.0.0.1:1"}) == "sum"
    with pytest.raises(ValueError, match="remote_backend.loss_reduction=mean: use one of auto, sum, sequence_mean"):
        loss_reduction({"loss_reduction": "mean", "base_url": "http://127.0.0.1:1"})


def test_an_overlapped_run_is_declined_where_the_sampler_is_no_snapshot(dead_url: str) -> None:
    # Nothing answers at dead_url, so auto takes it for a snapshot service (hosted Tinker's SamplingClient);
    # against SkyRL's server auto declines (tests/tinker_service/test_tinker_server.py).
    assert TinkerBackend.cannot_overlap(_config(base_url=dead_url, snapshot_sampling="auto")) is None
    assert TinkerBackend.cannot_overlap(_config(base_url=dead_url, snapshot_sampling=True)) is None
    reason = TinkerBackend.cannot_overlap(_config(base_url=dead_url, snapshot_sampling=False))
    assert reason == "remote_backend.snapshot_sampling=false: the service samples from the weights it trains"
    with pytest.raises(ValueError, match=r"remote_backend.snapshot_sampling=sometimes: use auto, true or false"):
        TinkerBackend.preflight(_config(base_url=dead_url, snapshot_sampling="sometimes"))


def _config(**backend: Any) -> Any:
    return OmegaConf.create(
        {
            "remote_backend": {"loss_reduction": "auto", "connect_timeout_s": 1, "lora_rank": 32, **backend},
            "actor_rollout_ref": {"actor": {"entropy_coeff": 0.0}, "rollout": {"temperature": 1.0}},
        }
    )


@pytest.mark.faults
def test_preflight_names_the_missing_base_url() -> None:
    with pytest.raises(ValueError, match=r"remote_backend.base_url is not set: .*verl_remote_tinker.local_server"):
        TinkerBackend.preflight(_config(base_url=None))


@pytest.mark.parametrize("rank", [-1, 2.5, "four"])
def test_preflight_refuses_a_lora_rank_that_is_not_an_integer_from_0(rank: Any) -> None:
    with pytest.raises(
        ValueError, match=r"remote_backend.lora_rank=.*: out of range; expected an integer >= 0 \(a LoRA"
    ):
        TinkerBackend.preflight(_config(base_url="http://127.0.0.1:1", lora_rank=rank))


@pytest.mark.faults
def test_verls_lora_rank_is_the_adapters_and_two_ranks_are_refused() -> None:
    """verl's actor_rollout_ref.model.lora_rank (or .lora.rank) asks for a LoRA adapter: the Tinker backend trains one
    of that rank (it was ignored: a run asking for rank 8 trained rank 32); the backend's own setting, changed to
    another rank beside it, is refused."""
    import yaml

    from verl_remote_tinker.backend import DEFAULT_LORA_RANK, TinkerBackend, _validated

    shipped = yaml.safe_load((ROOT / "src" / "verl_remote_tinker" / "remote_backend" / "tinker.yaml").read_text())
    assert shipped["lora_rank"] == DEFAULT_LORA_RANK
    assert TinkerBackend.verl_lora

    def settings(backend_rank: int, **model: Any) -> dict[str, Any]:
        config = _config(base_url="http://127.0.0.1:1", lora_rank=backend_rank)
        config.actor_rollout_ref.model = model
        return _validated(config)

    assert settings(DEFAULT_LORA_RANK)["lora_rank"] == DEFAULT_LORA_RANK  # verl's 0: the backend's own
    assert settings(DEFAULT_LORA_RANK, lora_rank=8)["lora_rank"] == 8
    assert settings(DEFAULT_LORA_RANK, lora_rank=0, lora={"rank": 4})["lora_rank"] == 4
    assert settings(8, lora_rank=8)["lora_rank"] == 8
    assert settings(0)["lora_rank"] == 0
    with pytest.raises(ValueError, match=r"^actor_rollout_ref.model.lora_rank=8 and remote_backend.lora_rank=16 ask "):
        settings(16, lora_rank=8)


@pytest.mark.faults
def test_preflight_names_an_address_where_nothing_answers(dead_url: str) -> None:
    with pytest.raises(ValueError, match=f"remote_backend.base_url={dead_url}: nothing answers there"):
        TinkerBackend.preflight(_config(base_url=dead_url))


def test_a_phases_overlapping_requests_count_once_and_a_take_starts_again() -> None:
    clock = WaitClock()
    began = time.perf_counter()
    clock.begin("gen")
    clock.begin("gen")  # 64 samples waited on together are one wait
    time.sleep(0.05)
    clock.end("gen")
    time.sleep(0.05)
    clock.end("gen")
    clock.begin("update_actor")  # still waiting when taken: counts up to now, and on from now
    taken = clock.take()
    elapsed = time.perf_counter() - began
    assert 0.1 <= taken["gen"] <= elapsed and 0 <= taken["update_actor"] < 0.05, taken
    time.sleep(0.02)
    clock.end("update_actor")
    again = clock.take()
    assert set(again) == {"update_actor"} and 0.02 <= again["update_actor"] < 0.5, again
    assert clock.take() == {}


def test_the_sdk_range_is_the_distributions() -> None:
    """The range a refusal names is the one the distribution declares."""
    project = tomllib.loads((ROOT / "dists" / "verl-remote-tinker" / "pyproject.toml").read_text())["project"]
    assert f"tinker{SDK_RANGE}" in project["dependencies"]


def test_the_run_summary_says_what_waiting_on_the_service_cost_each_phase() -> None:
    summary = RunSummary([0.1, 0.2], shares={"update_weights": [0.9, 0.8, 0.7], "gen": [0.5, 0.7], "x": [0.1]})
    assert summary.waits_line() == (
        "verl-remote: waiting on the service took 60% of generation, 80% of the weight sync, 10% of x "
        "(medians over 3 steps)"
    )
    assert RunSummary([0.1]).waits_line() is None  # a backend that reports no waits


@pytest.mark.faults
@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("ftp://127.0.0.1:8000", "remote_backend.base_url=ftp://127.0.0.1:8000: the scheme ftp:// is not one"),
        ("127.0.0.1:8000", "remote_backend.base_url=127.0.0.1:8000: not a URL; expected http://HOST:PORT"),
        ("http://bob:s3cret@127.0.0.1:8000", "remote_backend.base_url=http://***@127.0.0.1:8000: a user or password"),
    ],
)
def test_preflight_refuses_a_url_of_another_scheme_or_with_a_password_never_shown(url: str, message: str) -> None:
    with pytest.raises(ValueError) as refused:
        TinkerBackend.preflight(_config(base_url=url))
    assert str(refused.value).startswith(message)
    assert "s3cret" not in str(refused.value) and "bob" not in str(refused.value)
    if "***" in message:
        assert "remote_backend.api_key_env" in str(refused.value)  # where the key goes instead


@pytest.mark.faults
def test_a_hosted_service_without_a_key_is_refused_a_key_file_is_read_and_a_clear_key_warned(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl_remote_tinker.credentials import NO_KEY, api_key, credentials_problem

    hosted = "https://tinker.thinkingmachines.dev/services/tinker-prod"
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    with pytest.raises(ValueError, match=r"is Thinking Machines' hosted Tinker, which needs an API key.*export "):
        TinkerBackend.preflight(_config(base_url=hosted, api_key_env="TINKER_API_KEY"))
    assert api_key({"api_key_env": "TINKER_API_KEY"}) == NO_KEY  # a local server takes the placeholder
    key_file = tmp_path / "key"
    with pytest.raises(ValueError, match=r"remote_backend.api_key_file=.*key: cannot read it \(No such file"):
        api_key({"api_key_file": str(key_file)})
    key_file.write_text("\n")
    with pytest.raises(ValueError, match=r"remote_backend.api_key_file=.*key: the file is empty"):
        api_key({"api_key_file": str(key_file)})
    key_file.write_text("tml-from-a-file\n")
    assert api_key({"api_key_file": str(key_file), "api_key_env": "TINKER_API_KEY"}) == "tml-from-a-file"
    assert credentials_problem(hosted, {"api_key_file": str(key_file)}) == (None, None)
    monkeypatch.setenv("TINKER_API_KEY", "tml-from-the-environment")
    assert api_key({"api_key_env": "TINKER_API_KEY"}) == "tml-from-the-environment"
    refused, warned = credentials_problem("http://10.1.2.3:8000", {"api_key_env": "TINKER_API_KEY"})
    assert refused is None and warned is not None and "plain http to a host that is not this machine" in warned
    assert credentials_problem("http://127.0.0.1:8000", {"api_key_env": "TINKER_API_KEY"}) == (None, None)
    assert "tml-from" not in warned


@pytest.mark.faults
@pytest.mark.parametrize(
    ("installed", "refused", "warned"),
    [("0.25.0", True, False), ("0.27.1", True, False), ("0.28.0", False, False), ("0.30.2", False, True),
     ("0.38.0", False, False)],
)  # fmt: skip
def test_hosted_tinker_with_an_sdk_it_refuses_is_refused_before_ray_naming_the_floor(
    installed: str, refused: bool, warned: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Hosted Tinker refuses tinker 0.27 and older (the run failed at its first call, after Ray and verl started)
    and deprecates 0.29 to 0.32; a local or open server is not asked."""
    import importlib.metadata

    from verl_remote_tinker import credentials

    real = importlib.metadata.version
    monkeypatch.setattr(
        credentials.importlib.metadata, "version", lambda name: installed if name == "tinker" else real(name)
    )
    hosted = "https://tinker.thinkingmachines.dev/services/tinker-prod"
    said = credentials.hosted_sdk_problem(hosted)
    assert (said[0] is not None, said[1] is not None) == (refused, warned)
    if refused:
        assert said[0] == (
            f"remote_backend.base_url={hosted} is Thinking Machines' hosted Tinker, which refuses tinker SDK "
            f"{installed} (0.27 and older): pip install 'tinker>=0.33,<0.39' (SkyRL's and the other open Tinker "
            "servers need tinker<0.26: keep them in an environment of their own)"
        )
        key = tmp_path / "key"
        key.write_text("tml-a-key\n")
        with pytest.raises(ValueError, match="which refuses tinker SDK"):
            TinkerBackend.preflight(_config(base_url=hosted, api_key_file=str(key)))
    assert credentials.hosted_sdk_problem("http://127.0.0.1:8000") == (None, None)
    reach = credentials.sdk_reach()
    assert reach.startswith(f"tinker SDK {installed} reaches ")
    assert ("not hosted Tinker" in reach) == (installed < "0.26")


@pytest.mark.faults
def test_a_probe_reads_an_answer_that_does_not_end_up_to_a_cap() -> None:
    from conftest import endless_answer
    from verl_remote_tinker.backend import ANSWER_CAP_BYTES, serves_skyrl

    with endless_answer(200) as answer:
        TinkerBackend.preflight(_config(base_url=answer.url))  # it answers the health route: enough
        assert serves_skyrl({"base_url": answer.url}, timeout=10) is False  # not SkyRL's JSON
    assert len(answer.sent) == 2 and all(n < ANSWER_CAP_BYTES + (8 << 20) for n in answer.sent), answer.sent


def test_models_the_service_did_not_confirm_unloading_are_what_destroy_left_on_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """verl-remote-tinker's left_on_service (what verl-remote check's destroy reads): each model whose
    unload_model failed, with the service's answer; nothing once every unload is confirmed."""
    import asyncio

    from verl_remote_tinker import sdk
    from verl_remote_tinker.session import TinkerSession

    unloaded: list[str] = []

    async def unload(service: Any, model_id: str) -> None:
        if model_id == "policy-2":
            raise ValueError("Error code: 500 - model busy")  # the SDK's words for a failed future
        unloaded.append(model_id)

    async def finish(service: Any) -> None:
        return None

    monkeypatch.setattr(sdk, "unload", unload)
    monkeypatch.setattr(sdk, "finish", finish)
    optim = {"lr": 1e-3, "lr_scheduler_type": "constant", "lr_warmup_steps": 0, "total_training_steps": 2}
    session = TinkerSession({"base_url": "http://127.0.0.1:9", "timeout_s": 5.0}, "base", optim)
    session.service, session.model_ids = object(), ["policy-1", "policy-2"]
    left = asyncio.run(session.close())
    assert unloaded == ["policy-1"]
    said = "Tinker call unload_model (http://127.0.0.1:9): ValueError: Error code: 500 - model busy"
    assert left == [f"model policy-2 ({said})"]
    assert asyncio.run(session.close()) == []  # closed: nothing more to say
