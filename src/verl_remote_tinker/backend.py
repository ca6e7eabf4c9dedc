"""``TinkerBackend``: the RemoteBackend contract over one Tinker session (:mod:`verl_remote_tinker.session`).

The driver starts the session actor, which connects to the service at ``remote_backend.base_url``, creates
the run's LoRA training client and its samplers; the forwarder and every rollout server re-attach to the
actor by name. Weight sync saves the trained weights for sampling (every rollout server samples through the
same session, so all switch at once); a checkpoint is the service's own (``save_state``), its path recorded
under verl's checkpoint folder; resume makes a training client from that state, with its optimizer.
"""

from __future__ import annotations

import json
import logging
import os
import warnings
from typing import Any

import httpx
from omegaconf import OmegaConf

from verl_remote import (
    RayService,
    RemoteBackend,
    SamplingParams,
    ServiceStartError,
    as_dict,
    one_line,
    overlapped,
    resources,
    service_url,
)
from verl_remote_tinker.credentials import credentials_problem, hosted_sdk_problem, sdk_reach

__all__ = ["TinkerBackend", "check_objective", "loss_reduction"]

log = logging.getLogger(__name__)

#: What a checkpoint of this backend is, inside verl's ``global_step_N/actor`` folder.
CHECKPOINT_FILE = "tinker_checkpoint.json"
REDUCTIONS = ("sum", "sequence_mean")


def check_objective(actor: dict[str, Any], rollout: dict[str, Any]) -> None:
    """Refuse the verl settings whose objective the Tinker API cannot compute.

    The service returns the log-prob of each target token at temperature 1 and nothing else of the
    distribution: verl's loss is sent as its gradient with respect to those log-probs, which covers every
    policy loss, KL term and aggregation verl has, but not an entropy bonus nor log-probs at another
    temperature.
    """
    coeff = float(actor.get("entropy_coeff") or 0.0)
    if coeff != 0.0:
        raise ValueError(
            f"actor_rollout_ref.actor.entropy_coeff={coeff}: a Tinker service returns the log-prob of each sampled "
            "token only, not the distribution an entropy bonus needs; set actor_rollout_ref.actor.entropy_coeff=0"
        )
    temperature = float(rollout.get("temperature", 1.0))
    if temperature != 1.0:
        raise ValueError(
            f"actor_rollout_ref.rollout.temperature={temperature}: a Tinker service scores tokens at temperature 1 "
            "only, and verl's loss needs the log-probs at the sampling temperature; set "
            "actor_rollout_ref.rollout.temperature=1.0 (validation may still sample greedily)"
        )
    optimizer = str((actor.get("optim") or {}).get("optimizer") or "AdamW")
    if optimizer != "AdamW":
        raise ValueError(
            f"actor_rollout_ref.actor.optim.optimizer={optimizer}: a Tinker service steps with AdamW (decoupled "
            "weight decay) only; set actor_rollout_ref.actor.optim.optimizer=AdamW"
        )


def loss_reduction(settings: dict[str, Any], timeout: float = 10.0) -> str:
    """How the service reduces a loss over tokens (remote_backend.loss_reduction, auto resolved).

    auto: SkyRL's JAX backend divides each sequence's loss by the sum of its weights and the accumulated
    gradient by the number of sequences (skyrl/backends/jax.py, ``loss_for_lora`` and
    ``AccumulatedGradients.get_mean``): sequence_mean on SkyRL's server. Any other service: Tinker's documented
    sum.
    """
    value = _reduction_setting(settings)
    if value in REDUCTIONS:
        return value
    return "sequence_mean" if serves_skyrl(settings, timeout) else "sum"


def serves_skyrl(settings: dict[str, Any], timeout: float = 10.0) -> bool:
    """Whether the service is SkyRL's Tinker server, which names itself "Tinker API Mock" at ``GET /``
    (skyrl 0.4.0 tinker/api.py:2093-2098, ``root``); False where nothing answers."""
    if not settings.get("base_url"):
        return False
    try:
        answer = json.loads(_get(str(settings["base_url"]).rstrip("/") + "/", timeout)[1])
    except (httpx.HTTPError, ValueError):
        return False
    return isinstance(answer, dict) and answer.get("name") == "Tinker API Mock"


#: Why an overlapped run on SkyRL's server would sample the wrong weights.
SKYRL_LIVE_SAMPLER = (
    "SkyRL's Tinker server samples a LoRA model from the adapter its optimizer steps, not from a snapshot of the "
    "last saved sampler weights (skyrl 0.4.0 backends/jax.py:1031-1034), so the next step's samples would come "
    "from weights verl's staleness tags do not name; remote_backend.snapshot_sampling=true overlaps anyway"
)


def _snapshot_setting(settings: dict[str, Any]) -> bool | str:
    """remote_backend.snapshot_sampling: whether a sampler keeps the weights it was saved from while the trainer
    goes on changing them (a Tinker ``SamplingClient`` is such a snapshot): true, false or auto (true but on
    SkyRL's server, :data:`SKYRL_LIVE_SAMPLER`)."""
    value = settings.get("snapshot_sampling", "auto")
    if isinstance(value, bool):
        return value
    if value == "auto":
        return "auto"
    raise ValueError(f"remote_backend.snapshot_sampling={value}: use auto, true or false")


class TinkerBackend(RemoteBackend):
    """Every process holds a handle to the run's one session actor."""

    #: verl's ``actor_rollout_ref.model.lora_rank`` (or ``.lora.rank``) is the LoRA training client's rank.
    verl_lora = True

    @classmethod
    def doctor_notes(cls) -> list[str]:
        return [sdk_reach()]

    def __init__(self, service: RayService, reduction: str) -> None:
        self.service = service
        self.session = service.actor()
        self.reduction = reduction
        self.left: list[str] = []  # what destroy could not release on the service (left_on_service)
        self._closed = False

    @classmethod
    def probe_service(cls, main_config: Any) -> None:
        """The service answers its health route, with the settings checked as :meth:`preflight` does."""
        with warnings.catch_warnings():  # preflight's to say, once
            warnings.simplefilter("ignore", UserWarning)
            _healthy(_validated(main_config))

    @classmethod
    def preflight(cls, main_config: Any) -> None:
        """The settings honoured, the service answering its health route; nothing is created."""
        _healthy(_validated(main_config))

    @classmethod
    def cannot_overlap(cls, main_config: Any) -> str | None:
        settings = as_dict(main_config.remote_backend)
        value = _snapshot_setting(settings)
        if value is False:
            return "remote_backend.snapshot_sampling=false: the service samples from the weights it trains"
        if value == "auto" and serves_skyrl(settings, timeout=float(settings.get("connect_timeout_s", 10))):
            return SKYRL_LIVE_SAMPLER
        return None

    @classmethod
    def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> TinkerBackend:
        if handle is not None:
            return cls(RayService.from_handle(handle), str(handle["reduction"]))

        settings = _validated(main_config)
        base_url, rank, actor = _base_url(settings), _lora_rank(settings), as_dict(main_config.actor_rollout_ref.actor)
        _healthy(settings)
        reduction = loss_reduction(settings, timeout=float(settings.get("connect_timeout_s", 10)))
        base_model = str(settings.get("base_model") or main_config.actor_rollout_ref.model.path)
        optim = dict(actor.get("optim") or {})
        if float(optim.get("clip_grad") or 0.0) > 0 and reduction == "sequence_mean":
            log.warning(
                "verl-remote-tinker: SkyRL's Tinker server does not clip gradients (its AdamParams has no "
                "grad_clip_norm); actor_rollout_ref.actor.optim.clip_grad=%s is sent and not applied",
                optim.get("clip_grad"),
            )
        from verl_remote_tinker.session import TinkerSession

        try:
            service = RayService.start(
                TinkerSession,
                {**settings, "base_url": base_url, "overlap": overlapped(main_config)},
                base_model,
                optim,
                prefix="verl_remote_tinker_session",
                num_cpus=resources(settings)["num_cpus"],
            )
        except ServiceStartError as exc:
            raise RuntimeError(f"verl-remote-tinker: {exc}") from None
        backend = cls(service, reduction)
        try:
            started = service.call("start")
        except Exception as exc:
            service.stop()
            if rank == 0:
                raise RuntimeError(
                    f"verl-remote-tinker: remote_backend.lora_rank=0 asks for full fine-tuning, which the service "
                    f"at {base_url} does not offer ({_said(exc)}); set remote_backend.lora_rank to a LoRA rank it "
                    "serves (SkyRL's server: 1 to its --max-lora-rank, 32 by default)"
                ) from None
            raise RuntimeError(f"verl-remote-tinker: the service at {base_url} refused the run: {_said(exc)}") from None
        log.info(
            "verl-remote-tinker: training %s (%s) as model %s on %s; loss reduction %s",
            base_model,
            "full fine-tuning" if rank == 0 else f"LoRA rank {rank}",
            started["model_id"],
            base_url,
            reduction,
        )
        return backend

    def reconnect_handle(self) -> dict[str, Any]:
        return {**self.service.handle(), "reduction": self.reduction}

    @classmethod
    def requires_single_forwarder(cls) -> bool:
        # One training client, one optimizer: several forwarders would each step it per mini-batch.
        return True

    # -- lifecycle ----------------------------------------------------------------------------

    async def update_weights(self) -> None:
        await self.service.call_async("update_sampler")

    async def save_checkpoint(self, step: int, path: str) -> None:
        state = await self.service.call_async("save", f"verl-step-{step}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CHECKPOINT_FILE), "w") as f:
            json.dump({"step": step, **state}, f, indent=2)

    @classmethod
    def export(cls, main_config: Any, step: int, path: str, out: str, *, adapter: bool = False) -> None:
        """The step's LoRA from the service (its sampler checkpoint's archive), merged into the run's base model,
        or with ``adapter`` as a PEFT adapter folder (:mod:`verl_remote_tinker.export`)."""
        from verl_remote_tinker.export import export_step

        record = os.path.join(path, CHECKPOINT_FILE)
        if not os.path.isfile(record):
            raise ValueError(f"{record} is missing: this checkpoint was not saved by verl-remote-tinker")
        with open(record) as f:
            state = json.load(f)
        settings = as_dict(main_config.remote_backend)
        _healthy(settings)
        export_step(
            settings, str(state["tinker_path"]), main_config.actor_rollout_ref.model, step, out, adapter=adapter
        )

    async def load_checkpoint(self, step: int, path: str) -> None:
        record = os.path.join(path, CHECKPOINT_FILE)
        if not os.path.isfile(record):
            raise FileNotFoundError(
                f"{record} is missing: this checkpoint was not written by verl-remote-tinker, so there is no service "
                "checkpoint to resume from"
            )
        with open(record) as f:
            state = json.load(f)
        await self.service.call_async("load", state)

    async def service_waits(self) -> dict[str, float]:
        return dict(await self.service.call_async("waits"))

    async def destroy(self) -> None:
        import ray

        if not self._closed:
            self._closed = True
            try:
                self.left += await self.session.close.remote()
            except (ray.exceptions.RayActorError, ValueError):  # the session ended first: its models not unloaded
                self.left.append("the run's models (its session ended before destroy could unload them)")
        self.service.stop()

    async def left_on_service(self) -> list[str]:
        """The models the service did not confirm unloading when destroy asked it to (their ``unload_model``
        answers)."""
        return list(self.left)

    # -- compute, used by this backend's worker and replica -------------------------------------

    def forward(self, rows: list[list[int]], *, update: bool = False) -> list[Any]:
        return list(self.service.call("forward", rows, update=update))

    def reference(self, rows: list[list[int]]) -> list[Any]:
        return list(self.service.call("reference", rows))

    def submit_forward_backward(self, datums: list[dict[str, Any]]) -> None:
        self.service.call("submit_forward_backward", datums)

    def optim_step(self) -> dict[str, float]:
        return dict(self.service.call("optim_step"))

    def end_of_step(self) -> float:
        return float(self.service.call("end_of_step"))

    async def sample(self, prompt: list[int], params: SamplingParams) -> dict[str, Any]:
        return dict(await self.service.call_async("sample", prompt, params))

    async def sample_group(self, prompt: list[int], params: SamplingParams, n: int) -> list[dict[str, Any]]:
        return list(await self.service.call_async("sample_group", prompt, params, n))


def _validated(main_config: Any) -> dict[str, Any]:
    """``remote_backend`` as a dict, every setting and verl's objective checked: the one validation
    :meth:`TinkerBackend.preflight` (before Ray) and :meth:`TinkerBackend.from_config` share."""
    settings = as_dict(main_config.remote_backend)
    url = _base_url(settings)
    for refused, warned in (credentials_problem(url, settings), hosted_sdk_problem(url)):
        if refused:
            raise ValueError(refused)
        if warned:
            warnings.warn(warned, UserWarning, stacklevel=2)
    settings["lora_rank"] = _lora_rank(settings, main_config)
    check_objective(as_dict(main_config.actor_rollout_ref.actor), as_dict(main_config.actor_rollout_ref.rollout))
    _reduction_setting(settings)
    _snapshot_setting(settings)
    return settings


def _base_url(settings: dict[str, Any]) -> str:
    url = settings.get("base_url")
    if not url:
        raise ValueError(
            "remote_backend.base_url is not set: point it at the Tinker-API service, e.g. "
            "remote_backend.base_url=http://127.0.0.1:8000 for a server started with "
            "'python -m verl_remote_tinker.local_server --port 8000'"
        )
    return service_url(
        "remote_backend.base_url",
        url,
        token_setting="remote_backend.api_key_env (an environment variable) or api_key_file",
    )


#: ``remote_backend.lora_rank`` in the group file (tests/tinker_service/test_tinker_mapping.py holds them equal).
DEFAULT_LORA_RANK = 32


def _lora_rank(settings: dict[str, Any], main_config: Any = None) -> int:
    """The LoRA adapter's rank: verl's (``actor_rollout_ref.model.lora_rank`` or ``.lora.rank``) where it asks for
    one, else ``remote_backend.lora_rank``, 0 asking for full fine-tuning where the service offers it (the Tinker
    API asks for it as a LoRA of rank 0). Both set, to different ranks, is refused."""
    value = settings.get("lora_rank")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"remote_backend.lora_rank={value}: out of range; expected an integer >= 0 (a LoRA rank, or 0 for full "
            "fine-tuning where the service offers it)"
        )
    verls = 0
    if main_config is not None:  # verl's keys: the older lora_rank, or lora.rank
        keys = ("actor_rollout_ref.model.lora_rank", "actor_rollout_ref.model.lora.rank")
        verls = max(int(OmegaConf.select(main_config, key, default=0) or 0) for key in keys)
    if verls == 0 or verls == value:
        return value
    if value != DEFAULT_LORA_RANK:
        raise ValueError(
            f"actor_rollout_ref.model.lora_rank={verls} and remote_backend.lora_rank={value} ask for two LoRA ranks; "
            "set one of them (verl's is the Tinker backend's when it is set)"
        )
    return verls


def _reduction_setting(settings: dict[str, Any]) -> str:
    value = str(settings.get("loss_reduction") or "auto")
    if value not in ("auto", *REDUCTIONS):
        raise ValueError(f"remote_backend.loss_reduction={value}: use one of auto, {', '.join(REDUCTIONS)}")
    return value


def _healthy(settings: dict[str, Any]) -> None:
    """The service answers ``GET /api/v1/healthz`` (the Tinker API's health route)."""
    url = _base_url(settings)
    timeout = float(settings.get("connect_timeout_s", 10))
    try:
        status, _ = _get(f"{url}/api/v1/healthz", timeout)
    except httpx.HTTPError as exc:
        raise ValueError(
            f"remote_backend.base_url={url}: nothing answers there ({one_line(exc)}); start the service "
            "(python -m verl_remote_tinker.local_server --port N for a local one) or set remote_backend.base_url to "
            "where it runs"
        ) from exc
    if status >= 400 and status not in (401, 403):
        raise ValueError(
            f"remote_backend.base_url={url}: GET /api/v1/healthz answered HTTP {status}; is a "
            "Tinker-API service at that address?"
        )


#: The most of a probe's answer read: whatever answers at a wrong URL (a file server, a stream that never ends)
#: costs at most this much memory and time.
ANSWER_CAP_BYTES = 1 << 20


def _get(url: str, timeout: float) -> tuple[int, bytes]:
    """``GET url``: the status and at most :data:`ANSWER_CAP_BYTES` of the body."""
    with httpx.stream("GET", url, timeout=timeout) as answer:
        head = bytearray()
        for chunk in answer.iter_bytes():
            head += chunk
            if len(head) >= ANSWER_CAP_BYTES:
                break
        return answer.status_code, bytes(head[:ANSWER_CAP_BYTES])


def _said(exc: BaseException) -> str:
    """What the service said: a TinkerError's message (the service's answer, in one line) without its type."""
    from verl_remote_tinker.session import TinkerError

    message = " ".join(str(exc).split())
    return message if isinstance(exc, TinkerError) and message else one_line(exc)
