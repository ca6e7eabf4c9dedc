"""``ArcticBackend``: the RemoteBackend contract over Arctic's RL service.

On the driver, :meth:`ArcticBackend.from_config` creates the service's jobs in
Arctic's order (sampling, then the reference ``log_prob`` job when verl needs
reference log-probs, then training) from ``remote_backend.*`` and verl's model
and optimizer settings, and waits until each is ``RUNNING``. Its reconnect
handle is the server URL, the protocol generation and the job ids, so that
forwarders and rollout servers attach without creating anything.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
from omegaconf import OmegaConf

from verl_arctic.client import ArcticClient, ArcticError, describe_answer, probe_generation
from verl_remote import RemoteBackend, resumes_from_checkpoint

__all__ = ["ArcticBackend", "as_dict", "job_configs"]

log = logging.getLogger(__name__)

POINTER_FILE = "arctic_checkpoint.json"


def as_dict(node: Any) -> dict[str, Any]:
    """A config section as a plain, resolved dict."""
    value = OmegaConf.to_container(node, resolve=True)
    if not isinstance(value, dict):
        raise TypeError(f"expected a config mapping, got {type(value).__name__}")
    return {str(k): v for k, v in value.items()}


def _token(comms: dict[str, Any]) -> str | None:
    if comms.get("protocol", "http") != "http":
        raise ValueError(
            f"remote_backend.comms.protocol={comms.get('protocol')!r} is not supported: verl-arctic talks to Arctic "
            "over HTTP (its Ray transport needs arctic_platform, which pins transformers<5, in verl's environment)"
        )
    token_env = comms.get("token_env")
    if not token_env:
        return None
    token = os.environ.get(str(token_env))
    if not token:
        raise ValueError(
            f"remote_backend.comms.token_env={token_env}: that environment variable is empty; "
            f"export {token_env}=<token> before the run"
        )
    return token


def _client(settings: dict[str, Any], generation: str) -> ArcticClient:
    comms = settings["comms"]
    token = _token(comms)
    return ArcticClient(
        str(comms["url"]),
        generation,
        token=token,
        connect_timeout=float(comms.get("connect_timeout_s", 10)),
        read_timeout=float(comms.get("read_timeout_s", 1800)),
        retries=int(comms.get("retries", 3)),
    )


def _training_steps(config: Any, actor: dict[str, Any]) -> int | None:
    """verl's number of training steps, when it is known before verl counts its data (0 when it is not).

    verl sets ``actor.optim.total_training_steps`` from the data set's length after the backend is built;
    Arctic fixes its learning-rate schedule when the training job is created, so only
    ``trainer.total_training_steps`` can size it then.
    """
    for steps in (actor["optim"].get("total_training_steps"), config.trainer.get("total_training_steps")):
        if steps is not None and int(steps) > 0:
            return int(steps)
    return None


def _optim(actor: dict[str, Any], horizon: int) -> tuple[dict[str, Any], float]:
    optim = actor["optim"]
    clip = float(optim.get("clip_grad") or actor.get("grad_clip") or 0.0)
    total = max(horizon, 1)
    warmup = int(optim.get("lr_warmup_steps") or -1)
    if warmup <= 0:
        warmup = round(float(optim.get("lr_warmup_steps_ratio") or 0.0) * horizon)
    return {
        "lr": float(optim["lr"]),
        "weight_decay": float(optim.get("weight_decay") or 0.0),
        "betas": [float(b) for b in optim.get("betas", (0.9, 0.999))],
        "scheduler": str(optim.get("lr_scheduler_type") or "constant"),
        "warmup_steps": warmup,
        "min_lr_ratio": float(optim.get("min_lr_ratio") or 0.0),
        "total": total,
    }, clip


#: What Arctic's ``verl_grpo`` loss computes whatever verl's config says (arctic-platform 0.1.2
#: rl/processors/verl_grpo.py:195-198, 0.1.4 the same): clip ratios fixed, the vanilla policy loss.
ARCTIC_LOSS = {"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}


def check_objective(actor: dict[str, Any]) -> None:
    """Refuse verl loss settings Arctic's server would silently replace with its own."""
    for key, fixed in ARCTIC_LOSS.items():
        value = actor.get(key)
        if value is not None and float(value) != fixed:
            raise ValueError(
                f"actor_rollout_ref.actor.{key}={value}: Arctic's verl_grpo loss clips at 0.2 (low and high) with a "
                f"dual-clip bound of 3.0 whatever it is sent, so it would train a different objective; "
                f"set actor_rollout_ref.actor.{key}={fixed}"
            )
    mode = str((actor.get("policy_loss") or {}).get("loss_mode") or "vanilla")
    if mode != "vanilla":
        raise ValueError(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}: Arctic's verl_grpo loss is verl's vanilla PPO "
            "policy loss only; set actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"
        )


def _zero(deepspeed: dict[str, Any]) -> dict[str, Any]:
    return dict(deepspeed.get("zero_optimization") or {})


def job_configs(config: Any, generation: str) -> dict[str, dict[str, Any]]:
    """The ``/initialize`` bodies, by job type, for a composed run config (docs/arctic-backend.md maps each key)."""
    settings = as_dict(config.remote_backend)
    actor = as_dict(config.actor_rollout_ref.actor)
    model_config = config.actor_rollout_ref.model
    rollout = config.actor_rollout_ref.rollout
    model = str(model_config.path)
    rollout_n = int(rollout.n)
    train_batch = int(actor["ppo_mini_batch_size"]) * rollout_n
    mini_batches = max(int(config.data.train_batch_size) * rollout_n // train_batch, 1)
    steps = _training_steps(config, actor)
    horizon = (steps or 1) * int(actor.get("ppo_epochs", 1)) * mini_batches
    optim, clip = _optim(actor, horizon)
    if steps is None and (optim["scheduler"] == "cosine" or float(actor["optim"].get("lr_warmup_steps_ratio") or 0)):
        raise ValueError(
            f"actor_rollout_ref.actor.optim.lr_scheduler_type={optim['scheduler']} with a warm-up ratio needs the "
            "number of training steps before the run starts: Arctic fixes its learning-rate schedule when the "
            "training job is created; set trainer.total_training_steps"
        )
    deepspeed = dict(settings["train"]["deepspeed"])
    micro = int(actor.get("ppo_micro_batch_size_per_gpu") or 1)
    gpus = max(int(settings.get("training_gpus", 1)), 1)
    if train_batch % (micro * gpus):
        raise ValueError(
            f"Arctic trains each mini-batch of {train_batch} sequences (ppo_mini_batch_size x rollout.n) on "
            f"{gpus} GPU(s) in micro-batches of {micro} (ppo_micro_batch_size_per_gpu); DeepSpeed needs the first "
            "to be a multiple of the product: change ppo_mini_batch_size or ppo_micro_batch_size_per_gpu"
        )
    ds_config = {
        **deepspeed,
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": train_batch,
        "gradient_accumulation_steps": train_batch // (micro * gpus),
    }
    # Arctic's workers load the model with this attention backend (main requires one); verl's override, or
    # the flash-attention default Arctic's own verl integration sends.
    override = model_config.get("override_config") or {}
    worker = {
        "attn_implementation": str(override.get("attn_implementation") or "flash_attention_2"),
        "enable_gradient_checkpointing": bool(model_config.get("enable_gradient_checkpointing", False)),
    }
    determinism = settings["train"]["determinism"]
    arctic_inference = dict(settings["rollout"])
    common = {"model_name": model, "seed": int(determinism["seed"])}
    training: dict[str, Any] = {
        **common,
        "job_type": "training",
        "full_determinism": bool(determinism["full"]),
        "checkpoint_path": os.path.abspath(str(config.trainer.default_local_dir)),
        "ds_worker_config": worker,
    }
    if generation == "main":
        ds = dict(ds_config)
        ds["optimizer"] = {
            "type": "AdamW",
            "params": {k: optim[k] for k in ("lr", "weight_decay", "betas")} | {"eps": 1e-8},
        }
        if clip > 0:
            ds["gradient_clipping"] = clip
        # DeepSpeed's schedulers take only their own keyword arguments and a positive integer warm-up; a
        # constant rate without warm-up is no scheduler at all. DeepSpeed warms up over at least 2 steps.
        if optim["scheduler"] == "cosine":
            ds["scheduler"] = {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": horizon,
                    "warmup_num_steps": max(1, optim["warmup_steps"]),
                    "warmup_min_ratio": 0.0,
                    "cos_min_ratio": optim["min_lr_ratio"],
                    "warmup_type": "linear",
                },
            }
        elif optim["warmup_steps"] > 0:
            ds["scheduler"] = {
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": optim["lr"],
                    "warmup_num_steps": optim["warmup_steps"],
                    "warmup_type": "linear",
                },
            }
        training |= {
            "ds_config": ds,
            "cuda_ipc": bool(settings["weight_sync"]["cuda_ipc"]),
            "low_memory": bool(settings["weight_sync"]["low_memory"]),
        }
    else:
        training |= {
            "ds_config": ds_config,
            "arctic_inference_config": arctic_inference,
            "training_config": {
                "training_horizon": horizon,
                "optimizer": {k: optim[k] for k in ("lr", "weight_decay", "betas")}
                | ({"gradient_clipping": clip} if clip > 0 else {}),
                "lr_scheduler": {
                    "type": optim["scheduler"],
                    "warmup_ratio": optim["warmup_steps"] / max(horizon, 1),
                    "min_lr_ratio": optim["min_lr_ratio"],
                },
            },
        }
    max_model_len = rollout.get("max_model_len") or int(rollout.prompt_length) + int(rollout.response_length)
    sampling = {
        **common,
        "job_type": "sampling",
        "arctic_inference_config": arctic_inference,
        "vllm_config": {
            "tensor_parallel_size": int(settings.get("sampling_tp_size", 1)),
            "gpu_memory_utilization": float(rollout.get("gpu_memory_utilization") or 0.5),
            "max_model_len": int(max_model_len),
            "max_num_seqs": int(rollout.get("max_num_seqs") or 1024),
            "enforce_eager": bool(rollout.get("enforce_eager", True)),
        },
    }
    # The reference engine is forward-only: DeepSpeed refuses ZeRO stages 1 and 2 without an optimizer,
    # so it shards parameters (stage 3) when training does and runs unsharded (stage 0) otherwise.
    zero = _zero(deepspeed)
    reference_zero = {"stage": 3 if int(zero.get("stage", 0)) == 3 else 0}
    if "offload_param" in zero:
        reference_zero["offload_param"] = zero["offload_param"]
    log_prob = {
        **common,
        "job_type": "log_prob",
        "full_determinism": bool(determinism["full"]),
        "ds_config": {k: v for k, v in ds_config.items() if k != "optimizer"},
        "ds_worker_config": worker,
        "log_prob_config": {"zero_optimization": reference_zero},
    }
    # Arctic's creation order: sampling, the reference, then training (the weight-sync root) last.
    jobs = {"sampling": sampling}
    if actor.get("use_kl_loss") or config.algorithm.get("use_kl_in_reward"):
        if int(settings["log_prob_gpus"]) <= 0:
            raise ValueError(
                "verl needs reference log-probs (a KL term is on) but remote_backend.log_prob_gpus is 0: "
                "give the reference job GPUs, or turn the KL terms off"
            )
        jobs["log_prob"] = log_prob
    jobs["training"] = training
    return jobs


def refusal_hint(job_type: str, body: dict[str, Any], generation: str) -> str:
    """What in ``body`` Arctic's DeepSpeed is known to refuse; Arctic answers every such failure with a bare 500."""
    hints = []
    ds = body.get("ds_config") or {}
    if job_type == "training":
        stage = int(_zero(ds).get("stage", 0))
        data_types = ds.get("data_types") or {}
        if stage == 0 and str(data_types.get("grad_accum_dtype", "fp32")) in ("fp32", "float32"):
            hints.append(
                "ZeRO stage 0 with Arctic's bf16 weights and fp32 gradient accumulation is refused by DeepSpeed: "
                "set remote_backend.train.deepspeed.zero_optimization.stage to 1, 2 or 3"
            )
        schedule = (body.get("training_config") or {}).get("lr_scheduler") or {}
        if generation == "v0.1" and (schedule.get("type") == "cosine" or float(schedule.get("warmup_ratio") or 0) > 0):
            hints.append(
                "arctic-platform 0.1.2 hands DeepSpeed a fractional warm-up step count, which DeepSpeed 0.19.8 "
                "refuses: with protocol v0.1 use a constant learning rate without warm-up "
                "(actor_rollout_ref.actor.optim.lr_scheduler_type=constant, lr_warmup_steps_ratio=0)"
            )
    if job_type == "log_prob" and int(_zero(body.get("log_prob_config") or {}).get("stage", 0)) in (1, 2):
        hints.append("a forward-only DeepSpeed engine cannot use ZeRO stage 1 or 2")
    hints.append(f"the server's own log names the cause (the {job_type} job's body is {json.dumps(body)[:2000]})")
    return "; ".join(hints)


#: In the run's checkpoint folder while the run's jobs exist (see ArcticBackend.write_record).
JOBS_FILE = "arctic_jobs.json"

#: The training job's ``checkpoint_path`` is ``<checkpoint folder>/<RUN_DIR_PREFIX><run id>``: a folder no other
#: run sends, so that a recorded job can be told from another run's job with the same id
#: (see :func:`_why_not_proven`).
RUN_DIR_PREFIX = "arctic-run-"


def _answer(client: ArcticClient, job_id: int) -> dict[str, Any] | None:
    """The server's ``/job`` answer, or None when it holds no such job."""
    try:
        return client.job(job_id)
    except ArcticError as exc:
        if exc.status == 404:
            return None
        raise


def _why_not_proven(
    left: dict[str, Any], jobs: dict[str, int], answers: dict[str, dict[str, Any] | None]
) -> str | None:
    """None when the recorded jobs the server still holds are the dead run's own; otherwise why they may not be.

    Arctic hands out job ids from 1 again after a restart, so a recorded id alone proves nothing. What Arctic
    echoes of a job (both generations: ``job_info`` at the end of ``/initialize``) is its type, its model and, for
    the training job only, ``<the checkpoint_path sent>/arctic_rl_job_<id>``; the path sent is unique to the run
    (``RUN_DIR_PREFIX``). So the training job proves itself, and the others are proven by it: ids are never
    reused within one server process, the record names one server, and a run creates its training job last, so
    a sampling or log-prob job recorded with a smaller id on the server that holds the proven training job is
    the same run's.
    """
    sent = left.get("checkpoint_path")
    training = jobs.get("training")
    if not sent or training is None:
        return "the record is from a run that did not record what proves its jobs"
    info = answers.get("training")
    if info is None:
        return f"its training job {training} is gone, so nothing proves the others are the run's own"
    expected = os.path.join(str(sent), f"arctic_rl_job_{training}")
    if info.get("job_type") != "training" or str(info.get("checkpoint_path")) != expected:
        return (
            f"job {training} on the server is not the recorded run's (its checkpoint_path is "
            f"{info.get('checkpoint_path')!r}, the recorded run's is {expected!r}): the server restarted and another "
            "run holds that id"
        )
    for kind, job in jobs.items():
        answer = answers.get(kind)
        if kind == "training" or answer is None:
            continue
        if job >= training or answer.get("job_type") != kind or answer.get("model_name") != left.get("model_name"):
            found = f"{answer.get('job_type')}, {answer.get('model_name')}"
            return f"{kind} job {job} on the server does not match the record ({found})"
    return None


def clean_up_after_a_dead_run(client: ArcticClient, record: str) -> None:
    """Destroy the jobs a run that ended without destroying them left on this server, when the server shows
    they are that run's own (:func:`_why_not_proven`); leave them otherwise, saying so in one line each.

    ``verl-remote train`` holds the checkpoint folder for its run, so a record there belongs to a run that is
    gone. Jobs on another server are not touched: the message says how to remove them.
    """
    if not os.path.isfile(record):
        return
    with open(record) as fp:
        left = json.load(fp)
    jobs = {str(kind): int(job) for kind, job in dict(left.get("jobs") or {}).items()}
    if str(left.get("url", "")).rstrip("/") != client.url:
        raise ValueError(
            f"{record}: a run that did not end cleanly left Arctic jobs {jobs} on {left.get('url')}, not on "
            f"{client.url}; destroy them there (POST {left.get('url')}/destroy?job_id=<id> with "
            '{"job_type": "<type>"}) and delete that file, or use another trainer.default_local_dir'
        )
    answers = {kind: _answer(client, job) for kind, job in jobs.items()}
    doubt = _why_not_proven(left, jobs, answers)
    for kind, job in jobs.items():
        if answers[kind] is None:
            continue  # gone already (the server restarted, or someone removed it)
        if doubt is not None:
            log.warning(
                "verl-arctic: left %s job %d on %s alone although %s records it: %s; if it is that dead run's, "
                "destroy it with POST %s/destroy?job_id=%d and the body {\"job_type\": \"%s\"}",
                kind, job, client.url, record, doubt, client.url, job, kind,
            )  # fmt: skip
            continue
        client.destroy(job, kind)
        log.warning(
            "verl-arctic: destroyed %s job %d on %s, left by a run that did not end cleanly", kind, job, client.url
        )
    os.unlink(record)


def check_server_size(client: ArcticClient, settings: dict[str, Any]) -> None:
    """The GPUs the server was launched with must be the ones the job configs are sized for."""
    status = client.call("status")
    for key in ("training_gpus", "sampling_gpus", "log_prob_gpus"):
        mine, theirs = int(settings.get(key, 1)), status.get(key)
        if theirs is not None and int(theirs) != mine and (key == "training_gpus" or (mine > 0) != (int(theirs) > 0)):
            raise ValueError(
                f"remote_backend.{key}={mine}, but the Arctic server at {client.url} was launched with "
                f"--{key.replace('_', '-')} {theirs}: set remote_backend.{key}={theirs}"
            )


def require_free_port(url: str) -> None:
    """The port of ``url`` must be free for a launched service: otherwise it could not listen there, and the
    run would talk to whatever does."""
    import socket

    port = httpx.URL(url).port or 80
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            raise ValueError(
                f"remote_backend.comms.url={url}: port {port} is already taken, so the service that "
                "remote_backend.comms.launch starts could not listen there and the run would talk to whatever "
                "does; stop that process or give the launch command and the url another port"
            ) from None


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGTERM the launched server when the process that launched it dies, even by SIGKILL."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class _Tail:
    lines: collections.deque[str]
    done: threading.Event


def _relay_stderr(proc: subprocess.Popen[bytes], keep: int = 15) -> _Tail:
    """Pass the launched server's stderr on to this process's (the run's log) and keep its last lines."""
    tail = _Tail(collections.deque(maxlen=keep), threading.Event())

    def relay() -> None:
        assert proc.stderr is not None
        try:
            for raw in iter(proc.stderr.readline, b""):
                line = raw.decode(errors="replace").rstrip()
                tail.lines.append(line)
                print(line, file=sys.stderr, flush=True)
        finally:
            tail.done.set()

    threading.Thread(target=relay, name="arctic-server-stderr", daemon=True).start()
    return tail


def launch_server(command: str, url: str, timeout: float) -> subprocess.Popen[bytes]:
    """Start the Arctic service with ``command`` and wait until ``url``/health answers.

    The port must be free first: otherwise the launched service cannot listen and whatever already does
    would answer in its place.
    """
    require_free_port(url)
    argv = shlex.split(command)
    if argv and argv[0] in ("python", "python3"):
        # The interpreter verl-remote runs under, with verl-arctic installed, not whichever is first on PATH
        # (a virtual environment used by its path, not activated, is not on it).
        argv[0] = sys.executable
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
    tail = _relay_stderr(proc)
    deadline = time.monotonic() + timeout
    while True:
        code = proc.poll()
        if code is not None:
            proc.wait()
            tail.done.wait(timeout=5)
            last = "\n".join(tail.lines) or "(nothing on stderr)"
            raise RuntimeError(
                f"the Arctic server command {command!r} exited with code {code} before becoming healthy; "
                f"its last lines on stderr:\n{last}"
            )
        try:
            if httpx.get(f"{url.rstrip('/')}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.terminate()
            raise TimeoutError(
                f"the Arctic server started with {command!r} was not healthy at {url} after {timeout:.0f}s"
            )
        time.sleep(0.5)


class ArcticBackend(RemoteBackend):
    """Jobs on one Arctic server; every process holds its own HTTP client to it."""

    def __init__(
        self,
        client: ArcticClient,
        jobs: dict[str, int],
        settings: dict[str, Any],
        server: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.client = client
        self.jobs = jobs
        self.settings = settings
        self.server = server  # the service process this backend launched, if it launched one
        self.record: str | None = None  # where the driver keeps the ids of the jobs it created
        self.checkpoint_path: str | None = None  # the training job's, as sent: unique to this run
        self.model_name: str | None = None
        self._destroyed = False

    def write_record(self) -> None:
        """The jobs this run created, kept in its checkpoint folder until they are destroyed, so that a run
        killed before it could destroy them (SIGKILL, a lost node) is cleaned up by the next one there; with
        what proves they are this run's (the training job's checkpoint path and the model sent)."""
        if self.record is None:
            return
        os.makedirs(os.path.dirname(self.record), exist_ok=True)
        body = {
            "url": self.client.url,
            "generation": self.client.generation,
            "jobs": self.jobs,
            "checkpoint_path": self.checkpoint_path,
            "model_name": self.model_name,
            "pid": os.getpid(),
        }
        with open(f"{self.record}.tmp", "w") as fp:
            json.dump(body, fp)
        os.replace(f"{self.record}.tmp", self.record)

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> ArcticBackend:
        settings = as_dict(main_config.remote_backend)
        if handle is not None:
            return cls(_client(settings, str(handle["generation"])), dict(handle["jobs"]), settings)
        comms = settings["comms"]
        server = None
        if comms.get("launch"):
            server = launch_server(str(comms["launch"]), str(comms["url"]), float(comms.get("startup_timeout_s", 300)))
        try:
            client = _client(settings, str(comms.get("api", "auto")))
        except BaseException:
            if server is not None:
                server.terminate()
            raise
        backend = cls(client, {}, settings, server)
        backend.record = os.path.join(str(main_config.trainer.default_local_dir), JOBS_FILE)
        timeout = float(settings["comms"].get("job_ready_timeout_s", 1800))
        try:
            check_objective(as_dict(main_config.actor_rollout_ref.actor))
            clean_up_after_a_dead_run(client, backend.record)
            check_server_size(client, settings)
            bodies = job_configs(main_config, client.generation)
            training = bodies["training"]
            training["checkpoint_path"] = os.path.join(training["checkpoint_path"], RUN_DIR_PREFIX + uuid.uuid4().hex)
            backend.checkpoint_path = training["checkpoint_path"]
            backend.model_name = str(training["model_name"])
            for job_type, body in bodies.items():
                if job_type == "sampling" and int(settings.get("sampling_gpus", 1)) <= 0:
                    continue
                try:
                    job_id = client.initialize(body)
                except ArcticError as exc:
                    if exc.status == 409:
                        raise ArcticError(
                            f"{exc}. The server holds another run's {job_type} job (Arctic runs one of each per "
                            "server): wait until that run ends, or set remote_backend.comms.url to another server",
                            status=409,
                        ) from exc
                    if exc.status != 500:
                        raise
                    hint = refusal_hint(job_type, body, client.generation)
                    raise ArcticError(f"{exc}. {hint}", status=500) from exc
                backend.jobs[job_type] = job_id
                backend.write_record()
                client.wait_running(job_id, timeout)
                log.info(
                    "verl-arctic: %s job %d is RUNNING on %s (%s)", job_type, job_id, client.url, client.generation
                )
            if "training" not in backend.jobs or "sampling" not in backend.jobs:
                raise ValueError(
                    "verl-arctic needs a training and a sampling job: set training_gpus and sampling_gpus > 0"
                )
        except BaseException:
            asyncio.run(backend.destroy())
            raise
        return backend

    @classmethod
    def preflight(cls, main_config: Any) -> None:
        """The service reachable and Arctic's, its protocol and GPUs as configured, the job configs valid."""
        settings = as_dict(main_config.remote_backend)
        check_objective(as_dict(main_config.actor_rollout_ref.actor))
        comms = settings["comms"]
        token = _token(comms)
        url = str(comms["url"]).rstrip("/")
        api = str(comms.get("api", "auto"))
        if comms.get("launch"):
            require_free_port(url)
            job_configs(main_config, api if api != "auto" else "main")
            return
        headers = {"Authorization": f"Bearer {token}"} if token else None
        timeout = float(comms.get("connect_timeout_s", 10))
        try:
            response = httpx.get(f"{url}/health", timeout=timeout, headers=headers)
        except httpx.HTTPError as exc:
            raise ValueError(
                f"remote_backend.comms.url={url}: nothing answers there ({exc}); start Arctic's RL server at that "
                "address, or set remote_backend.comms.url to where it runs (remote_backend.comms.launch starts one "
                "for the run)"
            ) from exc
        if response.status_code in (401, 403):
            raise ValueError(
                f"remote_backend.comms.url={url}: the server refused the credentials (HTTP {response.status_code}); "
                "set remote_backend.comms.token_env to the environment variable holding a valid token"
            )
        try:
            healthy = response.json() == {"status": "OK"}
        except ValueError:
            healthy = False
        if not healthy:
            raise ValueError(
                f"remote_backend.comms.url={url}: GET /health answered HTTP {response.status_code} with "
                f"{describe_answer(response)}, not Arctic's {{'status': 'OK'}}; "
                "is an Arctic RL server at that address?"
            )
        try:
            generation = probe_generation(url, timeout=timeout, headers=headers)
        except ArcticError as exc:
            raise ValueError(str(exc)) from exc
        if api not in ("auto", generation):
            raise ValueError(
                f"remote_backend.comms.api={api}, but the Arctic server at {url} speaks protocol {generation}; "
                f"set remote_backend.comms.api={generation} (or auto)"
            )
        if generation != "main" and resumes_from_checkpoint(main_config):
            raise ValueError(
                f"Arctic protocol {generation} at {url} has no load-checkpoint call, so a run cannot resume on it "
                f"(trainer.default_local_dir={main_config.trainer.default_local_dir} holds a checkpoint); resume "
                "against a server that speaks the main protocol, or set trainer.resume_mode=disable to start over"
            )
        client = ArcticClient(url, generation, token=token, connect_timeout=timeout, retries=0)
        try:
            check_server_size(client, settings)
        except ArcticError as exc:
            raise ValueError(str(exc)) from exc
        finally:
            client.close()
        job_configs(main_config, generation)

    def reconnect_handle(self) -> dict[str, Any]:
        return {"url": self.client.url, "generation": self.client.generation, "jobs": dict(self.jobs)}

    @classmethod
    def requires_single_forwarder(cls) -> bool:
        # Arctic runs its own data parallelism: one caller per mini-batch, one optimizer step each.
        return True

    # -- lifecycle ------------------------------------------------------------------------------

    def _sync_weights(self) -> None:
        sampling, training = self.jobs["sampling"], self.jobs["training"]
        sync = self.settings["weight_sync"]
        self.client.wake_inference(sampling, ["weights"])
        self.client.weight_sync(
            training,
            sampling,
            colocate=bool(self.settings.get("colocate", True)),
            cuda_ipc=bool(sync["cuda_ipc"]),
            low_memory=bool(sync["low_memory"]),
        )
        self.client.wake_inference(sampling, ["kv_cache"])
        self.client.reset_prefix_cache(sampling)

    async def update_weights(self) -> None:
        await asyncio.to_thread(self._sync_weights)

    async def save_checkpoint(self, step: int, path: str) -> None:
        if self.client.generation == "main":
            saved = await asyncio.to_thread(self.client.save, self.jobs["training"], os.path.join(path, "arctic"), step)
        else:  # v0.1 saves where the server decides; remember where
            saved = await asyncio.to_thread(self.client.save, self.jobs["training"], path, step)
        with open(os.path.join(path, POINTER_FILE), "w") as fp:
            json.dump({"step": step, "server": self.client.url, "generation": self.client.generation, **saved}, fp)

    async def load_checkpoint(self, step: int, path: str) -> None:
        if self.client.generation != "main":
            raise ArcticError(
                f"Arctic protocol v0.1 at {self.client.url} has no load-checkpoint call, so a run cannot resume on it; "
                "resume against a server that speaks the main protocol (remote_backend.comms.api=main)"
            )
        loaded = await asyncio.to_thread(
            self.client.load_checkpoint, self.jobs["training"], os.path.join(path, "arctic"), step
        )
        if int(loaded.get("global_step", 0)) == 0:
            raise ArcticError(f"Arctic server {self.client.url} found no checkpoint for step {step} under {path}")

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        left = []
        for job_type in ("training", "log_prob", "sampling"):
            job_id = self.jobs.get(job_type)
            if job_id is None:
                continue
            try:
                await asyncio.to_thread(self.client.destroy, job_id, job_type)
            except ArcticError as exc:  # keep going: the other jobs still hold GPUs
                if exc.status == 404:
                    continue  # gone already (the server restarted)
                left.append(job_type)
                log.warning("verl-arctic: could not destroy %s job %d: %s", job_type, job_id, exc)
        if self.record is not None and os.path.exists(self.record):
            if left:  # the next run in this folder destroys them once the server answers again
                log.warning(
                    "verl-arctic: the %s job(s) stay recorded in %s; the next run in this folder destroys them",
                    " and ".join(left),
                    self.record,
                )
            else:
                os.unlink(self.record)
        self.client.close()
        if self.server is not None:
            self.server.terminate()
            try:
                await asyncio.to_thread(self.server.wait, 60)
            except subprocess.TimeoutExpired:
                self.server.kill()

    # -- compute, used by this backend's worker and rollout server ---------------------------------

    def forward(self, payload: dict[str, Any], *, reference: bool) -> dict[str, Any]:
        if reference and "log_prob" not in self.jobs:
            raise ValueError(
                "reference log-probs were asked for, but this run made no reference job: verl-arctic makes one "
                "when a KL term is on (actor_rollout_ref.actor.use_kl_loss or algorithm.use_kl_in_reward)"
            )
        job = self.jobs["log_prob"] if reference else self.jobs["training"]
        return self.client.forward(job, payload)

    def forward_backward(self, payload: dict[str, Any]) -> dict[str, Any]:
        return self.client.forward_backward(self.jobs["training"], payload)

    def step(self) -> dict[str, Any]:
        return self.client.step(self.jobs["training"])

    async def generate(self, prompt: str, sampling_params: dict[str, Any]) -> dict[str, Any]:
        result = await self.client.agenerate(self.jobs["sampling"], [prompt], sampling_params)
        return dict(result["results"][0])

    async def sleep_sampling(self) -> None:
        await asyncio.to_thread(self.client.sleep_inference, self.jobs["sampling"], 1)
