"""verl-arctic's client against the protocol-faithful test server, both generations, over HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from verl_arctic import wire
from verl_arctic.client import ArcticClient, ArcticError, probe_generation
from verl_remote.demo.assets import ensure_demo_assets


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(ensure_demo_assets().model_path)


def _dense_batch(pad: int) -> dict[str, torch.Tensor]:
    """Two rows in Arctic's layout: prompts left-padded to P=5, responses right-padded to R=3."""
    prompts = torch.tensor([[3, 13, 15, 2, 8], [pad, 3, 13, 2, 8]])
    responses = torch.tensor([[15, 15, 2], [7, pad, pad]])
    input_ids = torch.cat([prompts, responses], dim=1)
    attention_mask = (input_ids != pad).long()
    response_mask = torch.zeros_like(input_ids)
    response_mask[:, 5:] = (responses != pad).long()
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": response_mask,
    }


def test_the_generation_is_detected_without_side_effects(arctic_server: tuple[str, str]) -> None:
    url, generation = arctic_server
    assert probe_generation(url) == generation
    assert ArcticClient(url).generation == generation
    assert ArcticClient(url).call("status")["jobs"] == {}


def test_job_lifecycle_and_the_servers_own_error_texts(
    arctic_server: tuple[str, str], model_path: str, tmp_path: Path
) -> None:
    url, generation = arctic_server
    client = ArcticClient(url, generation)
    sampling = client.initialize({"model_name": model_path, "job_type": "sampling", "seed": 1})
    training = client.initialize({"model_name": model_path, "job_type": "training", "checkpoint_path": str(tmp_path)})
    assert (sampling, training) == (1, 2)
    client.wait_running(training, timeout=10)
    info = client.job(training)
    assert info["status"] == "RUNNING" and info["checkpoint_path"] == str(tmp_path / "arctic_rl_job_2")
    assert set(client.call("status")["jobs"]) == {"1", "2"}

    with pytest.raises(ArcticError, match="HTTP 409: Training job already running") as dup:
        client.initialize({"model_name": model_path, "job_type": "training", "checkpoint_path": str(tmp_path)})
    assert dup.value.status == 409
    with pytest.raises(
        ArcticError,
        match=r"Arctic call step \(POST http://127.0.0.1:\d+/step\?job_id=1\) failed: "
        r"HTTP 400: Job 1 is not a training job",
    ):
        client.step(sampling)
    with pytest.raises(ArcticError, match="HTTP 404: Job 9 not found"):
        client.step(9)
    # Arctic's forward route looks the job up before checking it: unknown jobs are a bare 500.
    with pytest.raises(ArcticError, match="HTTP 500: Internal Server Error"):
        client.forward(9, {"batch": {}, "meta": {}, "processing": {}})

    client.destroy(training, "training")
    with pytest.raises(ArcticError, match=f"Arctic call job \\(GET {url}/job/2\\) failed: HTTP 404: Job 2 not found"):
        client.job(training)
    client.destroy(sampling, "sampling")


def test_forward_update_step_sync_and_generate(arctic_server: tuple[str, str], model_path: str, tmp_path: Path) -> None:
    url, generation = arctic_server
    client = ArcticClient(url, generation)
    sampling = client.initialize({"model_name": model_path, "job_type": "sampling"})
    optimizer = {"lr": 0.05, "betas": [0.9, 0.999], "weight_decay": 0.0}
    config = {"model_name": model_path, "job_type": "training", "checkpoint_path": str(tmp_path)}
    if generation == "main":
        config["ds_config"] = {"optimizer": {"type": "AdamW", "params": optimizer}, "gradient_clipping": 1.0}
    else:
        config["training_config"] = {"training_horizon": 4, "optimizer": {**optimizer, "gradient_clipping": 1.0}}
    training = client.initialize(config)

    pad = 0
    batch = _dense_batch(pad)
    meta = {"temperature": 1.0, "calculate_entropy": True, "pad_token_id": pad, "drop_position_ids": True}
    forward = client.forward(training, {"batch": batch, "meta": meta, "processing": {"post": [], "loss_fn": None}})
    logprobs = forward["batch"]["logprobs"]
    assert logprobs.shape == (2, 8) and forward["batch"]["entropy"].shape == (2, 8)
    assert logprobs[1, 0] == pad and logprobs[1, 6] == pad  # padded positions carry pad_token_id
    assert (logprobs[0, :7] < 0).all()  # roll(-1): position i is log p(token i+1)

    # Response-aligned inputs, left-padded with zeros to the full length.
    old = torch.zeros(2, 8)
    old[:, 5:] = torch.roll(logprobs, shifts=1, dims=-1)[:, 5:] * batch["response_mask"][:, 5:]
    advantages = torch.zeros(2, 8)
    advantages[0, 5:], advantages[1, 5] = 1.0, -1.0
    update_meta = {
        **meta,
        "actor_config": {"clip_ratio": 0.2, "loss_agg_mode": "token-mean", "entropy_coeff": 0.0},
        "policy_loss_config": {"loss_mode": "vanilla"},
        "global_batch_size": 2,
        "batch_num_tokens": torch.tensor(4),
    }
    payload = {
        "batch": {**batch, "old_log_probs": old, "advantages": advantages},
        "meta": update_meta,
        "processing": {"post": ["apply_temperature", "compute_entropy_and_logprobs"], "loss_fn": "verl_grpo"},
    }
    result = client.forward_backward(training, payload)
    assert set(result) == {"job_id", "metrics", "avg_loss"}
    assert result["metrics"]["actor/pg_clipfrac"] == 0.0  # on-policy: ratio 1, nothing clipped
    assert result["avg_loss"] == pytest.approx(result["metrics"]["loss"])
    stepped = client.step(training)["metrics"]
    assert stepped["last_lr"] == pytest.approx(0.05) and stepped["grad_norm"] > 0

    norms = client.weight_norm(training, sampling)
    assert norms["training_num_params"] == norms["sampling_num_params"]
    assert norms["training_norm"] != pytest.approx(norms["sampling_norm"])  # the step changed training only

    prompt = "user: say 7 <|im_end|> assistant:"
    greedy = {"temperature": 0.0, "max_tokens": 6}
    before = client.generate(sampling, [prompt], greedy)["results"][0]
    assert set(before) >= {"text", "token_ids", "finish_reason"} and len(before["token_ids"]) <= 6
    client.sleep_inference(sampling)
    with pytest.raises(ArcticError, match="HTTP 500"):  # a sleeping pool cannot generate
        client.generate(sampling, [prompt], greedy)
    client.wake_inference(sampling, ["weights"])
    client.weight_sync(training, sampling, colocate=True, cuda_ipc=False, low_memory=False)
    client.wake_inference(sampling, ["kv_cache"])
    client.reset_prefix_cache(sampling)
    norms = client.weight_norm(training, sampling)
    assert norms["training_norm"] == pytest.approx(norms["sampling_norm"])  # the sync copied the new weights
    after = client.generate(sampling, [prompt], greedy)["results"][0]
    assert after["finish_reason"] in ("stop", "length") and len(after["token_ids"]) <= 6
    saved = client.save(training, str(tmp_path / "ckpt"), 3)
    assert Path(saved["path"]).is_dir()


def test_each_generation_refuses_the_other_generations_body_encoding(
    arctic_server: tuple[str, str], model_path: str, tmp_path: Path
) -> None:
    url, generation = arctic_server
    client = ArcticClient(url, generation)
    training = client.initialize({"model_name": model_path, "job_type": "training", "checkpoint_path": str(tmp_path)})
    other = "torch" if generation == "main" else "dssst1"
    path = "/forward-backward" if generation == "main" else "/fwd-bwd"
    body = {"batch": _dense_batch(0), "meta": {"pad_token_id": 0}, "processing": {"loss_fn": None}}
    response = httpx.post(f"{url}{path}?job_id={training}", content=wire.encode(other, body))
    assert (response.status_code, response.text) == (500, "Internal Server Error")
    own = httpx.post(f"{url}{path}?job_id={training}", content=wire.encode(client.encoding, body))
    assert own.status_code == 500  # well encoded, but a forward-backward without a loss function


def test_unreachable_server_and_timeouts_name_the_call_and_the_server(
    arctic_server: tuple[str, str], dead_url: str
) -> None:
    url, generation = arctic_server
    dead = dead_url
    with pytest.raises(ArcticError, match=f"cannot reach the Arctic server at {dead}"):
        ArcticClient(dead)
    client = ArcticClient(dead, generation, retries=1, connect_timeout=1)
    with pytest.raises(
        ArcticError, match=f"Arctic call health \\(GET {dead}/health\\) failed: cannot reach the server"
    ):
        client.health()
    slow = ArcticClient(url, generation, read_timeout=0.001)
    with pytest.raises(ArcticError, match=f"Arctic call initialize \\(POST {url}/initialize\\) timed out"):
        slow.initialize({"model_name": str(ensure_demo_assets().model_path), "job_type": "sampling"})
