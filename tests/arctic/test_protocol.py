"""verl-arctic's client against the test server, both generations, over HTTP.

Route by route agreement with Arctic's own server is tests/arctic/test_real_server.py;
this file checks what the client makes of the answers, and the training
semantics the test server models: DeepSpeed's accumulation boundary, data
parallelism, learning-rate warmup, weight syncs, checkpoints.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from conversation import forward_payload, training_config, update_payload

from conftest import arctic_jobs, free_port, serving_test_server
from verl_arctic import wire
from verl_arctic.client import ArcticClient, ArcticError, probe_generation
from verl_arctic.testing.engine import DeepSpeedRefusal, deepspeed_setup
from verl_remote.demo.assets import ensure_demo_assets


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(ensure_demo_assets().model_path)


def test_the_generation_is_detected_without_side_effects(arctic_server: tuple[str, str]) -> None:
    url, generation = arctic_server
    assert probe_generation(url) == generation
    assert ArcticClient(url).generation == generation
    assert ArcticClient(url).call("status")["jobs"] == {}


@pytest.mark.faults
def test_errors_name_the_call_the_url_and_the_servers_own_text(
    arctic_server: tuple[str, str], model_path: str, tmp_path: Path
) -> None:
    url, generation = arctic_server
    client = ArcticClient(url, generation)
    sampling = client.initialize({"model_name": model_path, "job_type": "sampling"})
    training = client.initialize(training_config(model_path, str(tmp_path), generation, ranks=1))
    assert (sampling, training) == (1, 2)
    client.wait_running(training, timeout=10)
    info = client.job(training)
    assert info["status"] == "RUNNING" and info["checkpoint_path"] == str(tmp_path / "arctic_rl_job_2")
    with pytest.raises(ArcticError, match="HTTP 409: Training job already running") as duplicate:
        client.initialize(training_config(model_path, str(tmp_path), generation, ranks=1))
    assert duplicate.value.status == 409
    with pytest.raises(
        ArcticError,
        match=r"Arctic call step \(POST http://127.0.0.1:\d+/step\?job_id=1\) failed: "
        r"HTTP 400: Job 1 is not a training job",
    ):
        client.step(sampling)
    with pytest.raises(ArcticError, match="HTTP 404: Job 9 not found"):
        client.step(9)
    with pytest.raises(ArcticError, match="HTTP 500: Internal Server Error"):  # Arctic looks the job up unchecked
        client.forward(9, forward_payload(4, 0))
    with pytest.raises(ArcticError, match=r"HTTP 422: .*'loc': \['body', 'model_name'\]"):
        client.initialize({"job_type": "sampling"})
    client.destroy(training, "training")
    with pytest.raises(ArcticError, match=f"Arctic call job \\(GET {url}/job/2\\) failed: HTTP 404: Job 2 not found"):
        client.job(training)


def test_a_refused_forward_names_the_generations_route(
    arctic_server: tuple[str, str], model_path: str, tmp_path: Path
) -> None:
    """What verl-arctic's forwarder sends for remote_backend.train.logits.optimization=memory, which Arctic's
    engines refuse without ZoRRO: the error names the call by its route in each generation. (A run stops at a
    failed call in one line and destroys its jobs: tests/arctic/test_arctic_train.py.)"""
    url, generation = arctic_server
    client = ArcticClient(url, generation)
    training = client.initialize(training_config(model_path, str(tmp_path), generation, ranks=1))
    payload = forward_payload(4, 0)
    payload["meta"]["logits_optimization"] = "memory"
    route = "forward" if generation == "main" else "fwd-no-grad"
    with pytest.raises(ArcticError, match=rf"Arctic call forward \(POST {url}/{route}\?job_id={training}\) failed: "):
        client.forward(training, payload)
    with pytest.raises(ArcticError, match="HTTP 500: Internal Server Error"):
        client.forward(training, payload)
    client.destroy(training, "training")
    assert client.call("status")["jobs"] == {}


def test_a_sampling_parameter_vllm_does_not_know_is_refused_as_arctic_refuses_it(
    arctic_server: tuple[str, str], model_path: str
) -> None:
    """Arctic builds vLLM's SamplingParams from the dict (arctic-inference server/worker.py), which refuses a
    name it does not know: a misnamed parameter (max_new_tokens for max_tokens) is a bare 500, not ignored."""
    url, generation = arctic_server
    client = ArcticClient(url, generation)
    sampling = client.initialize({"model_name": model_path, "job_type": "sampling"})
    assert len(client.generate(sampling, ["a"], {"max_tokens": 2, "stop_token_ids": [], "seed": 1})["results"]) == 1
    with pytest.raises(ArcticError, match=r"Arctic call generate \(POST .*\) failed: HTTP 500: Internal Server Error"):
        client.generate(sampling, ["a"], {"max_new_tokens": 2})
    client.destroy(sampling, "sampling")


@pytest.mark.parametrize("generation", ["v0.1", "main"])
def test_an_update_changes_the_weights_only_at_the_accumulation_boundary(
    generation: str, model_path: str, tmp_path: Path
) -> None:
    with serving_test_server(generation, training_gpus=2) as url:
        client = ArcticClient(url, generation)
        training = client.initialize(training_config(model_path, str(tmp_path), generation))
        sampling = client.initialize({"model_name": model_path, "job_type": "sampling"})
        before = client.forward(training, forward_payload(4, 0))["batch"]["logprobs"]
        assert before.shape == (4, 8) and before.dtype == torch.float32
        # 2 ranks x 2 micro-batches: each update carries 4 rows; the weights move at /step only.
        update = client.forward_backward(training, update_payload(4, 0))
        assert set(update) == {"job_id", "metrics", "avg_loss"}
        assert {"actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower", "loss"} <= set(
            update["metrics"]
        )
        assert torch.equal(client.forward(training, forward_payload(4, 0))["batch"]["logprobs"], before)
        stepped = client.step(training)["metrics"]
        assert stepped["last_lr"] == [0.01, 0.01] and len(stepped["grad_norm"]) == 2  # one value per rank
        after = client.forward(training, forward_payload(4, 0))["batch"]["logprobs"]
        assert not torch.equal(after, before)

        norms = client.weight_norm(training, sampling)
        assert norms["training_norm"] != pytest.approx(norms["sampling_norm"])
        client.wake_inference(sampling, ["weights"])
        client.weight_sync(training, sampling, colocate=True, cuda_ipc=False, low_memory=False)
        client.wake_inference(sampling, ["kv_cache"])
        norms = client.weight_norm(training, sampling)
        assert norms["training_norm"] == pytest.approx(norms["sampling_norm"])


def test_two_ranks_of_two_micro_batches_update_as_one_rank_of_four(model_path: str, tmp_path: Path) -> None:
    """Data parallelism as DeepSpeed does it: gradients averaged over ranks, the loss scaled by dp_size."""
    weights = []
    for ranks in (1, 2):
        with serving_test_server("main", training_gpus=ranks) as url:
            client = ArcticClient(url, "main")
            job = training_config(model_path, str(tmp_path / str(ranks)), "main", ranks=ranks)
            training = client.initialize(job)
            client.forward_backward(training, update_payload(4, 0))
            client.step(training)
            weights.append(client.forward(training, forward_payload(4, 0))["batch"]["logprobs"])
    torch.testing.assert_close(weights[0], weights[1], rtol=1e-5, atol=1e-5)


def test_deepspeed_refuses_what_arctic_would_pass_it() -> None:
    base = {
        "ds_config": {"zero_optimization": {"stage": 2}, "train_batch_size": 4, "gradient_accumulation_steps": 2},
        "ds_worker_config": {"attn_implementation": "sdpa"},
    }
    assert deepspeed_setup(base, "main", world=2).accumulation == 2
    with pytest.raises(DeepSpeedRefusal, match="train_batch_size is not equal"):
        deepspeed_setup(base, "main", world=1)
    with pytest.raises(DeepSpeedRefusal, match="bfloat16 and grad_accum_dtype=torch.float32"):
        deepspeed_setup({**base, "ds_config": {"zero_optimization": {"stage": 0}}}, "main", world=1)
    with pytest.raises(DeepSpeedRefusal, match="requires attn_implementation"):
        deepspeed_setup({"ds_config": base["ds_config"]}, "main", world=2)
    # v0.1 multiplies the warmup ratio by the horizon and passes the float on; DeepSpeed wants an integer.
    warmup = {
        "ds_config": {"zero_optimization": {"stage": 2}},
        "ds_worker_config": {"attn_implementation": "sdpa"},
        "training_config": {"training_horizon": 10, "optimizer": {"lr": 0.1}, "lr_scheduler": {"warmup_ratio": 0.2}},
    }
    with pytest.raises(DeepSpeedRefusal, match="warmup_num_steps must be a positive integer, got 2.0"):
        deepspeed_setup(warmup, "v0.1", world=1)
    assert deepspeed_setup(warmup, "main", world=1).scheduler["params"]["warmup_num_steps"] == 2


def test_warmup_follows_deepspeeds_schedule(model_path: str, tmp_path: Path) -> None:
    """DeepSpeed's WarmupLR: the first two optimizer steps run at the minimum, then the rate climbs linearly."""
    with serving_test_server("main") as url:
        client = ArcticClient(url, "main")
        job = training_config(model_path, str(tmp_path), "main", ranks=1)
        job["ds_config"]["scheduler"] = {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
        }
        training = client.initialize(job)
        rates = []
        for _ in range(5):
            client.forward_backward(training, update_payload(4, 0))
            rates.append(client.step(training)["metrics"]["last_lr"])
        assert rates == pytest.approx([0.0, 0.0025, 0.005, 0.0075, 0.01])  # each: the rate of the next step


def test_checkpoints_restore_weights_and_say_when_there_is_nothing(model_path: str, tmp_path: Path) -> None:
    with serving_test_server("main") as url:
        client = ArcticClient(url, "main")
        job = training_config(model_path, str(tmp_path / "jobs"), "main", ranks=1)
        training = client.initialize(job)
        client.forward_backward(training, update_payload(4, 0))
        client.step(training)
        saved = client.save(training, str(tmp_path / "ckpt"), 1)
        assert saved == {
            "job_id": training,
            "path": str(tmp_path / "ckpt" / "checkpoint-1"),
            "hf_path": None,
            "global_step": 1,
        }
        assert (tmp_path / "ckpt" / "latest").read_text() == "1"
        trained = client.forward(training, forward_payload(4, 0))["batch"]["logprobs"]
        client.forward_backward(training, update_payload(4, 0))
        client.step(training)
        assert client.load_checkpoint(training, str(tmp_path / "ckpt"), 1)["global_step"] == 1
        torch.testing.assert_close(client.forward(training, forward_payload(4, 0))["batch"]["logprobs"], trained)
        assert client.load_checkpoint(training, str(tmp_path / "ckpt"), 5)["global_step"] == 0


def test_each_generation_refuses_the_other_generations_body_encoding(
    arctic_server: tuple[str, str], model_path: str, tmp_path: Path
) -> None:
    url, generation = arctic_server
    client = ArcticClient(url, generation)
    training = client.initialize(training_config(model_path, str(tmp_path), generation, ranks=1))
    other = "torch" if generation == "main" else "dssst1"
    path = "/forward-backward" if generation == "main" else "/fwd-bwd"
    response = httpx.post(f"{url}{path}?job_id={training}", content=wire.encode(other, update_payload(4, 0)))
    assert (response.status_code, response.text) == (500, "Internal Server Error")
    own = httpx.post(f"{url}{path}?job_id={training}", content=wire.encode(client.encoding, update_payload(4, 0)))
    assert own.status_code == 200


def test_unreachable_server_and_timeouts_name_the_call_and_the_server(
    arctic_server: tuple[str, str], dead_url: str, silent_url: str, model_path: str
) -> None:
    _, generation = arctic_server
    dead = dead_url
    with pytest.raises(ArcticError, match=f"cannot reach the Arctic server at {dead}"):
        ArcticClient(dead)
    client = ArcticClient(dead, generation, retries=1, connect_timeout=1)
    with pytest.raises(
        ArcticError, match=f"Arctic call health \\(GET {dead}/health\\) failed: cannot reach the server"
    ):
        client.health()
    slow = ArcticClient(silent_url, generation, read_timeout=0.2)
    with pytest.raises(ArcticError, match=f"Arctic call initialize \\(POST {silent_url}/initialize\\) timed out"):
        slow.initialize({"model_name": model_path, "job_type": "sampling"})


def test_a_steps_generate_calls_share_one_client_and_a_failure_names_its_error(
    arctic_server: tuple[str, str], dead_url: str, silent_url: str, model_path: str
) -> None:
    """The rollout server sends a step's requests at once from one event loop (agenerate)."""
    url, generation = arctic_server
    client = ArcticClient(url, generation)
    sampling = client.initialize({"model_name": model_path, "job_type": "sampling"})
    try:
        params = {"max_tokens": 2, "ignore_eos": True, "temperature": 1.0}

        async def step() -> tuple[list[dict[str, Any]], set[int]]:
            answers = await asyncio.gather(*(client.agenerate(sampling, ["say 3"], params) for _ in range(32)))
            return answers, {id(client._async_client())}

        answers, clients = asyncio.run(step())
        assert len(answers) == 32 and all(len(a["results"][0]["token_ids"]) == 2 for a in answers)
        assert len(clients) == 1
        slow = ArcticClient(silent_url, generation, read_timeout=0.2)
        with pytest.raises(ArcticError, match=f"Arctic call generate \\(POST {silent_url}/generate.*\\) failed: \\S"):
            asyncio.run(slow.agenerate(sampling, ["say 3"], params))
    finally:
        client.destroy(sampling, "sampling")
    dead = ArcticClient(dead_url, generation)
    with pytest.raises(ArcticError, match=f"Arctic call generate \\(POST {dead_url}/generate.*\\) failed: \\S"):
        asyncio.run(dead.agenerate(1, ["say 3"], {"max_tokens": 2}))
    assert client.call("status")["jobs"] == {}


@pytest.mark.faults
def test_a_launched_server_runs_under_verl_remotes_python_and_an_early_exit_shows_its_last_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """comms.launch's `python` is the interpreter verl-remote runs under, whatever `python` PATH finds first."""
    from verl_arctic.launch import launch_server

    other = tmp_path / "bin"
    other.mkdir()
    (other / "python").write_text("#!/bin/sh\necho 'another python' >&2\nexit 42\n")
    (other / "python").chmod(0o755)
    monkeypatch.setenv("PATH", f"{other}{os.pathsep}{os.environ['PATH']}")
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as exited:
        launch_server("python -c 'import sys; print(sys.executable, file=sys.stderr); raise SystemExit(3)'", url, 60)
    assert "exited with code 3 before becoming healthy; its last lines on stderr:\n" in str(exited.value)
    assert str(exited.value).endswith(sys.executable)
    with pytest.raises(RuntimeError, match=r"(?s)code 1 before .*No module named verl_arctic\.no_such_module$"):
        launch_server("python -m verl_arctic.no_such_module", url, 60)


def test_the_replica_names_a_generate_answer_without_the_asked_log_probs() -> None:
    from verl_arctic.rollout import sampled_log_probs

    answer = {"text": "7 7", "token_ids": [5, 5], "finish_reason": "length"}
    with pytest.raises(ValueError, match=r"answered with no 'logprobs' for 2 sampled tokens \(answer keys: "):
        sampled_log_probs(answer, [5, 5], "http://arctic:7000")
    with pytest.raises(ValueError, match="without the log-prob of sampled token 5 at position 1"):
        sampled_log_probs(answer | {"logprobs": [{"5": {"logprob": -0.5}}, {"9": {"logprob": -1.0}}]}, [5, 5], "u")
    assert sampled_log_probs(answer | {"logprobs": [{"5": {"logprob": -0.5}}] * 2}, [5, 5], "u") == [-0.5, -0.5]


def test_a_success_whose_body_is_not_arctics_names_the_call_and_what_came(tmp_path: Path) -> None:
    """A proxy or another service at the address answers 200 with a page: said so, never a decoder's traceback."""
    import http.server
    import threading

    class Page(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            body = b"<html><body>Sign in to the proxy</body></html>"
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer  # the stdlib's names

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        client = ArcticClient(url, "main", retries=0)
        with pytest.raises(ArcticError) as binary:
            client.forward_backward(1, update_payload(2, 0))
        assert str(binary.value).startswith(
            f"Arctic call forward_backward (POST {url}/forward-backward?job_id=1) answered HTTP 200 with a body "
            "that is not Arctic's binary answer (<html><body>Sign in to the proxy</body></html> (text/html, not "
            "Arctic's JSON)): "
        )
        with pytest.raises(ArcticError, match=r"Arctic call health \(GET .*/health\) answered HTTP 200 with a body"):
            client.health()
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.faults
@pytest.mark.parametrize("generation", ["v0.1", "main"])
def test_a_resume_destroys_only_the_jobs_the_server_shows_are_its_dead_runs(
    generation: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Arctic numbers its jobs from 1 again after a restart, so a dead run's record may name another run's live
    jobs: the resume leaves them, says so, and cannot start beside them (one training job per server); the other
    run goes on. Without a restart, the record's jobs are the dead run's, and the resume destroys them."""
    from verl_arctic.backend import ArcticBackend
    from verl_arctic.record import JOBS_FILE
    from verl_remote.demo import resolve_demo_assets
    from verl_remote.discovery.compose import compose_config

    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def backend(folder: Path) -> ArcticBackend:
        config = compose_config([
            "remote_backend=arctic", f"remote_backend.comms.url={url}", f"remote_backend.comms.api={generation}",
            f"trainer.default_local_dir={folder}",
        ], recipe="demo")  # fmt: skip
        resolve_demo_assets(config)
        return ArcticBackend.from_config(config)

    def said(words: str) -> list[str]:
        return [r.getMessage() for r in caplog.records if words in r.getMessage()]

    dead, other = tmp_path / "dead", tmp_path / "other"
    caplog.set_level(logging.WARNING, logger="verl_arctic.record")
    with serving_test_server(generation, port=port):
        backend(dead).client.close()  # the run is killed: its jobs stay on the server, recorded in its folder
    recorded = json.loads((dead / JOBS_FILE).read_text())["jobs"]
    with serving_test_server(generation, port=port):  # the server restarted, empty
        running = backend(other)
        assert running.jobs == recorded  # the same ids, another run's jobs
        held = arctic_jobs(url)
        with pytest.raises(ArcticError, match="HTTP 409: .*The server holds another run's (sampling|training) job"):
            backend(dead)
        assert arctic_jobs(url) == held  # untouched
        for kind, job in recorded.items():
            (line,) = said(f"left {kind} job {job} on {url} alone")
            assert "the server restarted and another run holds that id" in line
            assert f"POST {url}/destroy?job_id={job}" in line
        assert said("destroyed") == []
        assert not (dead / JOBS_FILE).exists()  # said once; the next run there does not say it again
        asyncio.run(running.destroy())  # the other run ends as it would have
        assert arctic_jobs(url) == {}

        backend(dead).client.close()  # killed again, and resumed on the same server
        recorded = json.loads((dead / JOBS_FILE).read_text())["jobs"]
        resumed = backend(dead)
        for kind, job in recorded.items():
            assert said(f"destroyed {kind} job {job} on {url}, left by a run that did not end cleanly")
        assert set(arctic_jobs(url)) == {str(job) for job in resumed.jobs.values()}
        asyncio.run(resumed.destroy())
        assert arctic_jobs(url) == {} and not (dead / JOBS_FILE).exists()


@pytest.mark.faults
def test_an_answer_that_does_not_end_is_read_up_to_a_cap_and_described() -> None:
    """Whatever answers at a wrong URL (a file server, a proxy's stream) is read up to about 1 MiB: the probe and
    a failed call end with the answer's first line, not after reading it all (or never)."""
    from conftest import endless_answer
    from verl_arctic.client import ANSWER_CAP_BYTES, ArcticClient, ArcticError, probe_health

    with endless_answer(502) as answer:
        with pytest.raises(ArcticError, match=r"GET /health answered HTTP 502 with x{200}\.\.\."):
            probe_health(answer.url, timeout=10)
        client = ArcticClient(answer.url, "main", retries=0)
        with pytest.raises(ArcticError, match=r"Arctic call step \(POST .*\) failed: HTTP 502: x{200}\.\.\."):
            client.step(1)
        client.close()
    assert len(answer.sent) == 2 and all(n < ANSWER_CAP_BYTES + (8 << 20) for n in answer.sent), answer.sent
