"""The conformance checks: one installed backend, driven as verl-remote drives it, without verl's trainer.

The checks run in order and share one backend: the later ones need what the earlier ones made (the backend,
its worker and sampler, a sampled response). When one fails, those that need what it should have made are
reported as not run. Each result says what was checked and, when it fails, what to fix.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import math
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from verl_remote.testing.gradient import GRADIENT_RTOL
from verl_remote.testing.rows import responses_of as _responses_of
from verl_remote.testing.rows import split as _split

__all__ = ["CHECKS", "PRECISIONS", "CheckResult", "Conformance", "Tolerances"]

#: Absolute tolerance between log-probs that must agree (sampler vs trainer, one call vs the next), fp32.
DEFAULT_ATOL = 1e-3


@dataclass(frozen=True)
class Tolerances:
    """What the checks allow a service that computes in one precision."""

    #: Between log-probs that must agree (sampler vs trainer, one call vs the next, reference vs actor).
    atol: float
    #: The gradient check's: how far apart two updates by the same gradient may land, as a share of the move
    #: (verl_remote.testing.gradient.apart).
    gradient_rtol: float
    #: The gradient check's probe trains on the update's own rows (verl_remote.testing.gradient.own_rows_batch),
    #: not on rows of one token.
    probe_on_own_rows: bool = False


#: By the precision the service computes in (``verl-remote check --precision``). bf16's from Arctic's own 0.1.4
#: server on the demo's model, which trains and scores in bf16 whatever the client asks (docs/measurements.md,
#: "Every loss on every backend"): log-probs of the same tokens up to 0.99 apart between two engines (its
#: training engine and an fp32 sampler), 0.5 between its training and log-prob engines before any update; the
#: gradient check's probe of one token a row 23-58 % of the move off the backend's update by rounding alone, its
#: probe on the update's own rows within 2.2 %.
PRECISIONS: dict[str, Tolerances] = {
    "fp32": Tolerances(atol=DEFAULT_ATOL, gradient_rtol=GRADIENT_RTOL),
    "bf16": Tolerances(atol=1.0, gradient_rtol=GRADIENT_RTOL, probe_on_own_rows=True),
}


#: A reconnect handle larger than this (pickled) is not "small".
HANDLE_LIMIT_BYTES = 4096
SECRET_WORDS = ("TOKEN", "KEY", "SECRET", "PASSWORD", "CREDENTIAL")


class CheckFailed(AssertionError):
    """A check's finding: ``str`` says what is wrong, ``hint`` what to do."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str = ""
    hint: str = ""
    #: Not run, because an earlier check it needs failed.
    skipped: bool = False
    seconds: float = 0.0

    def line(self) -> str:
        mark = "skip" if self.skipped else ("ok  " if self.ok else "FAIL")
        text = f"[{mark}] {self.name}"
        if self.detail:
            text += f": {self.detail}"
        if not self.ok and not self.skipped and self.hint:
            text += f"\n       fix: {self.hint}"
        return text


def _expect(condition: bool, message: str, hint: str = "") -> None:
    if not condition:
        raise CheckFailed(message, hint)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class _State:
    config: Any = None
    backend: Any = None
    worker: Any = None
    server: Any = None
    prompts: list[list[int]] = field(default_factory=list)
    vocab: int = 0
    responses: list[list[int]] = field(default_factory=list)
    sampled_log_probs: list[list[float]] = field(default_factory=list)
    folder: str = ""
    #: Why the backend declines an overlapped run (RemoteBackend.cannot_overlap), or None when it runs one.
    declines: str | None = None
    #: The checkpoint check's save: its folder, rows, responses and the log-probs of the rows at the save.
    saved: tuple[str, list[list[int]], list[list[int]], np.ndarray] | None = None
    #: The weights version the rollout server was last told (one more at each sync, as a run's steps).
    version: int = 0


def _packed(rows: list[list[Any]], dtype: Any) -> Any:
    from verl_remote.kit.payload import Packed

    offsets = np.cumsum([0] + [len(r) for r in rows]).astype(np.int64)
    values = np.array([v for r in rows for v in r], dtype=dtype)
    return Packed(values, offsets)


def _release(made: tuple[Any, Any] | None) -> None:
    """End a backend the gradient check made for one loss, and its forwarder (both may be half made)."""
    import ray

    if made is None:
        return
    backend, worker = made
    if worker is not None:
        with contextlib.suppress(Exception):
            ray.kill(worker, no_restart=True)
    with contextlib.suppress(Exception):
        asyncio.run(backend.destroy())


#: The temperature other than 1 the weight-sync check samples at (a backend that ignores the temperature fails).
TEMPERATURE = 0.7


class Conformance:
    """The checks of one backend. ``run()`` returns one :class:`CheckResult` per check, in order."""

    def __init__(
        self,
        name: str,
        overrides: tuple[str, ...] = (),
        *,
        atol: float | None = None,
        losses: Sequence[Mapping[str, Any]] | None = None,
        precision: str = "fp32",
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: expected one of {', '.join(PRECISIONS)}")
        self.name = name
        self.overrides = tuple(overrides)
        #: The precision the service computes in, and what the checks allow it (``atol`` overrides its atol).
        self.precision = precision
        self.tolerances = PRECISIONS[precision]
        self.atol = self.tolerances.atol if atol is None else atol
        #: The losses the gradient check compares, each as actor settings on top of the config's ({}: as configured);
        #: None: every policy loss mode the backend claims (:meth:`claimed_losses`).
        self.losses = None if losses is None else [dict(settings) for settings in losses]
        #: Called with a line as each loss of the gradient check is done (``verl-remote check`` prints it).
        self.on_progress = on_progress
        self.state = _State()
        self._made: set[str] = set()
        self._baseline: set[int] = set()

    # -- the checks, in order ---------------------------------------------------------------------------

    def check_spec(self) -> str:
        """spec and group file: the entry point, its classes, and remote_backend/<name>.yaml with its name."""
        from verl_remote.discovery.registry import (
            get_backend_spec,
            load_backend_class,
            load_rollout_class,
            load_worker_class,
        )

        spec = get_backend_spec(self.name)
        for load in (load_backend_class, load_worker_class, load_rollout_class):
            load(self.name)
        from verl_remote.demo import DEMO_RECIPE, resolve_demo_assets
        from verl_remote.discovery.compose import compose_config
        from verl_remote.kit.config import OVERLAPPED_MODE, overlapped

        # A KL term on, so that the reference path and the loss's KL term are checked too (overrides win).
        kl = "actor_rollout_ref.actor.use_kl_loss=true"
        # The run's folder is the check's own temporary one, never the caller's working directory: a backend may
        # hand it to its service (Arctic's training job saves there). Removed by the cleanup.
        self.state.folder = tempfile.mkdtemp(prefix="verl-remote-check-")
        folder = f"trainer.default_local_dir={self.state.folder}"
        base = [kl, folder, f"remote_backend={self.name}"]
        # Built for an overlapped run (sampling while it trains) unless the backend declines one or the
        # overrides choose a mode: the overlap check then asks that its sampler keeps the synced weights.
        chosen = any(o.lstrip("+").startswith("trainer.v1.trainer_mode=") for o in self.overrides)
        mode = [] if chosen else [f"trainer.v1.trainer_mode={OVERLAPPED_MODE}"]
        config = compose_config([*base, *mode, *self.overrides], recipe=DEMO_RECIPE)
        if not overlapped(config):
            self.state.declines = f"the check runs trainer.v1.trainer_mode={config.trainer.v1.trainer_mode}"
        else:
            self.state.declines = load_backend_class(self.name).cannot_overlap(config)
            if self.state.declines is not None and not chosen:  # checked as its runs will run: synchronous
                config = compose_config([*base, *self.overrides], recipe=DEMO_RECIPE)
        _expect(
            config.remote_backend.get("name") == self.name,
            f"the group file's name is {config.remote_backend.get('name')!r}",
            f"put 'name: {self.name}' in remote_backend/{self.name}.yaml",
        )
        resolve_demo_assets(config)
        self.state.config = config
        return f"{spec.backend}, {spec.worker}, {spec.rollout}"

    def check_contract(self) -> str:
        """contract: the backend, worker and replica subclass verl-remote's bases."""
        from verl_remote.discovery.registry import load_backend_class, load_rollout_class, load_worker_class
        from verl_remote.integration.rollout import RemoteRolloutReplica, RemoteRolloutServer
        from verl_remote.integration.worker import RemoteForwarderWorker
        from verl_remote.kit.backend import RemoteBackend

        pairs = [
            (load_backend_class(self.name), RemoteBackend),
            (load_worker_class(self.name), RemoteForwarderWorker),
            (load_rollout_class(self.name), RemoteRolloutReplica),
            (getattr(load_rollout_class(self.name), "server_class", None), RemoteRolloutServer),
        ]
        for cls, base in pairs:
            _expect(
                isinstance(cls, type) and issubclass(cls, base),
                f"{cls!r} is not a subclass of {base.__module__}.{base.__qualname__}",
                "subclass verl-remote's base and override only the backend_* / sample methods",
            )
        return "RemoteBackend, RemoteForwarderWorker, RemoteRolloutReplica with a RemoteRolloutServer"

    def check_from_config(self) -> str:
        """from_config: the backend builds from the composed config (where verl's TaskRunner builds it)."""
        from verl_remote.discovery.registry import load_backend_class

        self._baseline = set(_children())  # what runs before the backend: not the backend's to stop
        self.state.backend = load_backend_class(self.name).from_config(self.state.config)
        self._made.add("backend")
        return type(self.state.backend).__qualname__

    def check_reconnect_handle(self) -> str:
        """reconnect_handle: a small dict of plain data, picklable, holding no secret from the environment."""
        from omegaconf import OmegaConf

        handle = self.state.backend.reconnect_handle()
        _expect(isinstance(handle, dict), f"it returned {type(handle).__name__}", "return a dict")
        blob = pickle.dumps(handle)
        _expect(pickle.loads(blob) == handle, "it does not survive pickling unchanged", "keep it to plain data")
        _expect(
            len(blob) <= HANDLE_LIMIT_BYTES,
            f"{len(blob)} bytes pickled",
            f"keep it under {HANDLE_LIMIT_BYTES} bytes: names and ids, not state",
        )
        try:
            OmegaConf.create(handle)
        except Exception as exc:
            raise CheckFailed(f"not plain data ({exc})", "use str, int, float, bool, list and dict only") from None
        text = repr(handle)
        for key, value in os.environ.items():
            if any(word in key.upper() for word in SECRET_WORDS) and len(value) >= 8 and value in text:
                raise CheckFailed(
                    f"it holds the value of ${key}", "read secrets from the environment in each process instead"
                )
        return f"{len(blob)} bytes"

    def check_worker_reattaches(self) -> str:
        """worker re-attaches: the forwarder builds from the handle in a separate Ray worker process."""
        import ray

        from verl_remote.integration.handoff import attach as attach_handoff
        from verl_remote.testing.hosts import WorkerHost

        config = self.state.config
        attach_handoff(config, self.name, self.state.backend.reconnect_handle())
        host = ray.remote(WorkerHost).options(num_cpus=0).remote(self.name, config.actor_rollout_ref, _free_port())
        pid = ray.get(host.pid.remote(), timeout=600)
        self.state.worker = host
        self._made.add("worker")
        return f"pid {pid}"

    def check_sampler_reattaches(self) -> str:
        """sampler re-attaches: the rollout server builds from the handle in a separate Ray worker process."""
        import ray

        from verl_remote.testing.hosts import ServerHost

        config = self.state.config
        host = (
            ray.remote(ServerHost)
            # As verl runs its rollout servers: Ray's default for async actors (verl's RolloutReplica.max_concurrency),
            # so a step's requests reach the sampler together, as they do in a run.
            .options(num_cpus=0, max_concurrency=1000)
            .remote(self.name, config.actor_rollout_ref.rollout, config.actor_rollout_ref.model)
        )
        pid = ray.get(host.pid.remote(), timeout=600)
        self.state.server = host
        self.state.vocab = int(ray.get(host.vocab_size.remote()))
        # As many rows as verl sends in one step (prompts x samples): services may split a batch by its size.
        rows = int(config.data.train_batch_size) * int(config.actor_rollout_ref.rollout.n)
        rng = np.random.default_rng(0)
        top = max(min(self.state.vocab, 1000), 2)
        self.state.prompts = [rng.integers(1, top, size=4 + i % 5).tolist() for i in range(max(rows, 3))]
        self._made.add("server")
        return f"pid {pid}"

    def check_log_prob_layout(self) -> str:
        """log-prob layout: one finite value per token of each row, the same for the same input, and position t
        scoring token t+1 (a teacher-forced re-score: changing a row's last token changes position n-2 only)."""
        rows = [p + q for p, q in zip(self.state.prompts, self.state.prompts[::-1], strict=True)]
        responses = [len(q) for q in self.state.prompts[::-1]]
        rows[-1], responses[-1] = list(rows[0]), responses[0]  # a repeated row must score the same
        lengths = [len(r) for r in rows]
        out = self._log_probs(rows, responses)
        _expect(
            len(out) == sum(lengths),
            f"{len(out)} values for rows of {lengths} tokens",
            "return one log-prob per position of input_ids, prompt included",
        )
        per_row = _split(out, lengths)
        _expect(bool(np.all(np.isfinite(out))), "some log-probs are not finite", "check the service's dtype/overflow")
        read = np.concatenate([r[:-1] for r in per_row])  # verl never reads a row's last position
        _expect(bool(np.all(read <= 1e-5)), f"a log-prob is positive ({read.max():.4g})", "return log-softmax values")
        diff = float(np.abs(per_row[0] - per_row[-1]).max())
        _expect(diff <= self.atol, f"the same row scored differently in one batch (by {diff:.3g})")
        again = self._log_probs(rows, responses)
        noise = float(np.abs(out - again).max())
        _expect(noise <= self.atol, f"the same batch scored differently twice (by {noise:.3g})")
        where = self._where_the_last_token_is_scored(rows, responses, per_row[0], noise)
        n = lengths[0]
        _expect(
            where == n - 2,
            f"changing a row's last token (position {n - 1} of {n}) changes the log-prob at "
            + (f"position {where}" if where is not None else "no position"),
            "position t must hold log p(input_ids[t+1] | input_ids[:t+1]), so the last token is scored at position "
            "n - 2; "
            + (
                f"these are shifted {abs(n - 2 - where)} position(s) {'early' if where < n - 2 else 'late'}"
                if where is not None
                else "the values do not depend on the tokens they score"
            )
            + " (verl_remote.kit.compute describes the layout)",
        )
        last = {round(float(r[-1]), 4) for r in per_row}
        note = "" if last == {0.0} else f"; the last positions hold {sorted(last)[:3]}, which verl never reads"
        return f"{len(rows)} rows of {min(lengths)}-{max(lengths)} tokens, token t+1 scored at t{note}"

    def _where_the_last_token_is_scored(
        self, rows: list[list[int]], responses: list[int], first: np.ndarray, noise: float
    ) -> int | None:
        """The first position of ``rows[0]`` whose log-prob changes, by more than the same batch's log-probs
        differ when it is scored twice (``noise``), when only its last token changes (None: none does); ``first``
        is that row's log-probs as they are. In verl's layout that is n - 2; the last position,
        which verl never reads, may change with it. The whole batch is sent each time, as verl sends it: a
        service splits a batch across its ranks and may refuse fewer rows than it has ranks."""
        lengths = [len(r) for r in rows]
        for delta in (1, 2, 3):
            changed = [[*rows[0][:-1], (rows[0][-1] + delta) % self.state.vocab], *rows[1:]]
            scored = _split(self._log_probs(changed, responses), lengths)[0]
            moved = np.flatnonzero(np.abs(scored - first) > noise + 1e-6)
            if len(moved):
                return int(moved[0])
        return None

    def check_reference(self) -> str:
        """reference log-probs: the same layout, and equal to the actor's before any update."""
        rows = [p + q for p, q in zip(self.state.prompts, self.state.prompts, strict=True)]
        responses = [len(q) for q in self.state.prompts]
        actor = self._log_probs(rows, responses)
        reference = self._log_probs(rows, responses, reference=True)
        _expect(len(reference) == len(actor), f"{len(reference)} reference values for {len(actor)} positions")
        diff = float(np.abs(actor - reference).max())
        _expect(
            diff <= self.atol,
            f"before any update the reference differs from the actor by {diff:.3g}",
            "reference=True must score with the initial weights (verl's KL terms use it)",
        )
        return f"max difference {diff:.2g}"

    def check_sampler(self) -> str:
        """sampler: honours max_tokens and the stop ids, returns one log-prob per token when asked."""
        import ray

        server = self.state.server
        params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
        for budget in (1, 3):
            out = ray.get(server.sample.remote(self.state.prompts[0], budget, params, []), timeout=300)
            got = len(out["token_ids"])
            _expect(
                1 <= got <= budget,
                f"max_tokens={budget} gave {got} tokens",
                "stop at max_tokens: verl sizes every response buffer by it",
            )
            _expect(
                out["log_probs"] is not None and len(out["log_probs"]) == got,
                f"logprobs asked, got {None if out['log_probs'] is None else len(out['log_probs'])} for {got} tokens",
                "return one log-prob per sampled token when sampling_params['logprobs'] is true",
            )
            _expect(out["stop_reason"] in ("completed", "aborted"), f"stop_reason {out['stop_reason']!r}")
        everything = list(range(self.state.vocab))
        out = ray.get(server.sample.remote(self.state.prompts[1], 4, params, everything), timeout=300)
        _expect(
            len(out["token_ids"]) == 1,
            f"with every token a stop token the response has {len(out['token_ids'])} tokens",
            "stop right after emitting any of self.stop_token_ids (the token itself included)",
        )
        out = ray.get(server.sample.remote(self.state.prompts[1], 2, dict(params, logprobs=False), []), timeout=300)
        _expect(1 <= len(out["token_ids"]) <= 2, f"without logprobs, {len(out['token_ids'])} tokens for max_tokens=2")
        greedy = dict(params, temperature=0.0)
        first, second = ray.get([server.sample.remote(self.state.prompts[2], 4, greedy, []) for _ in range(2)])
        _expect(
            first["token_ids"] == second["token_ids"] and all(math.isfinite(v) for v in first["log_probs"] or [0.0]),
            f"temperature 0 gave {first['token_ids']} then {second['token_ids']}, log-probs {first['log_probs']}",
            "temperature 0 (verl's validation default) means greedy decoding: the most likely token, finite "
            "log-probs, no division by zero",
        )
        return "max_tokens 1 and 3, stop ids, log-probs, greedy at temperature 0"

    def check_training_step(self) -> str:
        """training step: forward_backward and optimizer_step return finite metrics and change the policy."""
        import ray

        rows, responses = self._sample_rows(max_tokens=4)
        before = self._log_probs(rows, [len(r) for r in responses])
        fields, meta = self._mini_batch(rows, responses, before)
        metrics = ray.get(self.state.worker.forward_backward.remote(fields, meta), timeout=600)
        _expect(isinstance(metrics, dict), f"forward_backward returned {type(metrics).__name__}", "return a dict")
        step = ray.get(self.state.worker.optimizer_step.remote(), timeout=600)
        for key in ("grad_norm", "lr"):
            _expect(key in step, f"optimizer_step returned {sorted(step)}", "return at least 'grad_norm' and 'lr'")
        ray.get(self.state.worker.end_of_step.remote(), timeout=600)
        bad = [k for k, v in {**metrics, **step}.items() if not isinstance(v, float) or not math.isfinite(v)]
        _expect(not bad, f"metrics not finite: {bad}", "return plain finite floats")
        after = self._log_probs(rows, [len(r) for r in responses])
        change = float(np.abs(after - before).max())
        _expect(change > 0, "the log-probs are the same after an optimizer step", "apply the gradients")
        # verl reads no metric of forward_backward's by name (it logs them all): a missing 'loss' is a note.
        loss = next(
            (f"{key} {metrics[key]:.4g}, " for key in ("loss", "actor/pg_loss", "pg_loss") if key in metrics), ""
        )
        note = "" if "loss" in metrics else f"; no 'loss' among its {len(metrics)} metrics, which verl does not need"
        return f"{loss}grad_norm {step['grad_norm']:.4g}, lr {step['lr']:.3g}{note}"

    def check_weight_sync(self) -> str:
        """weight sync: after update_weights the sampler's log-probs equal the trainer's for the same tokens, at
        temperature 1 and at another (verl scores the old log-probs at the rollout's temperature), unless the
        backend refuses that temperature before a run (its preflight)."""
        self._sync_weights()
        worst = self._sampled_against_trained(1.0)
        _expect(
            worst <= self.atol,
            f"sampled and trained log-probs of the same tokens differ by up to {worst:.3g}",
            "update_weights must make the sampler use the trained weights; response token j of a row of n tokens "
            "with r response tokens is scored at position n - r - 1 + j",
        )
        refused = self._refuses_temperature(TEMPERATURE)
        if refused is not None:
            return (
                f"max difference {worst:.2g}; temperature {TEMPERATURE} not checked: the backend refuses it ({refused})"
            )
        tempered = self._sampled_against_trained(TEMPERATURE)
        _expect(
            tempered <= self.atol,
            f"at temperature {TEMPERATURE} sampled and trained log-probs of the same tokens differ by up to "
            f"{tempered:.3g} (at 1: {worst:.3g})",
            "sample from the logits divided by the temperature and return the log-probs of that distribution, as "
            "compute_log_prob scores them at the temperature verl passes; or refuse a temperature other than 1 in "
            "preflight",
        )
        return f"max difference {worst:.2g} at temperature 1, {tempered:.2g} at {TEMPERATURE}"

    def _sampled_against_trained(self, temperature: float) -> float:
        """The largest difference between the sampler's log-probs of its tokens and the trainer's of the same."""
        rows, responses = self._sample_rows(max_tokens=5, temperature=temperature)
        trained = self._log_probs(rows, [len(r) for r in responses], temperature=temperature)
        worst = 0.0
        for sampled, mine in zip(self.state.sampled_log_probs, _responses_of(trained, rows, responses), strict=True):
            worst = max(worst, float(np.abs(mine - np.asarray(sampled)).max()))
        return worst

    def _refuses_temperature(self, temperature: float) -> str | None:
        """The key the backend's preflight names when it refuses a run at this rollout temperature; None when it
        takes it."""
        return self._refused({"rollout.temperature": temperature}, "temperature")

    def _refused(self, settings: Mapping[str, Any], word: str) -> str | None:
        """The key the backend's preflight names when it refuses a run whose ``actor_rollout_ref`` has
        ``settings`` (dotted keys) on top of the checked config's, and the refusal is about ``word``; None when it
        takes it (a refusal for another reason, its service's port now taken by the check's own run, say, is not
        about the setting)."""
        from omegaconf import OmegaConf, open_dict

        from verl_remote.discovery.registry import load_backend_class

        config = copy.deepcopy(self.state.config)
        with open_dict(config):
            for key, value in settings.items():
                OmegaConf.update(config.actor_rollout_ref, key, value, force_add=True)
        try:
            load_backend_class(self.name).preflight(config)
        except ValueError as exc:
            said = str(exc)
            return said.split(":")[0] if word in said else None
        return None

    def claimed_losses(self) -> tuple[list[dict[str, Any]], list[str]]:
        """The losses the gradient check compares by default: each policy loss mode verl has that the backend
        claims (its preflight does not refuse a run with it, naming ``loss_mode``), the configured mode first,
        each with the configured aggregation and KL term; and the modes it refuses."""
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

        from verl_remote.testing.gradient import NEEDS

        configured = str(self.state.config.actor_rollout_ref.actor.policy_loss.loss_mode)
        claimed, refused = [], []
        for mode in sorted(POLICY_LOSS_REGISTRY, key=lambda name: (name != configured, name)):
            settings = {"policy_loss.loss_mode": mode, **NEEDS.get(mode, {})}
            actor = {f"actor.{key}": value for key, value in settings.items()}
            if self._refused(actor, "loss_mode"):
                refused.append(mode)
            else:
                claimed.append(settings)
        return claimed, refused

    def check_checkpoint(self) -> str:
        """save, train, load: load_checkpoint restores the log-probs of the save exactly, and the optimizer's state
        with them: the same training step after the load moves the model as it did after the save."""
        path = os.path.join(self.state.folder, "global_step_1", "actor")
        os.makedirs(path)
        rows, responses = self._sample_rows(max_tokens=4)
        lengths = [len(r) for r in responses]
        saved = self._log_probs(rows, lengths)
        asyncio.run(self.state.backend.save_checkpoint(1, path))
        self.state.saved = (path, rows, responses, saved)
        self._train_step(rows, responses, saved)
        changed = self._log_probs(rows, lengths)
        _expect(float(np.abs(changed - saved).max()) > 0, "a training step after the save changed nothing")
        asyncio.run(self.state.backend.load_checkpoint(1, path))
        restored = self._log_probs(rows, lengths)
        diff = float(np.abs(restored - saved).max())
        _expect(
            diff <= 1e-6,
            f"after load_checkpoint the log-probs differ from the saved ones by {diff:.3g}",
            "restore the weights (and the optimizer) that save_checkpoint wrote for that step",
        )
        # The optimizer's state (Adam's moments, its step count, the schedule's position): the step after the save,
        # taken again after the load, lands where it did. A fresh optimizer takes a step of another size.
        self._train_step(rows, responses, saved)
        again = self._log_probs(rows, lengths)
        moved = float(np.abs(changed - saved).max())
        apart = float(np.abs(again - changed).max())
        _expect(
            apart <= max(self.atol, 1e-3 * moved),
            f"the step after load_checkpoint moved the log-probs {apart:.3g} away from where the same step after the "
            f"save took them (it moved them {moved:.3g})",
            "save and restore the optimizer's state with the weights (its moments and step count, the learning-rate "
            "schedule's position): a resumed run must take the steps it would have taken",
        )
        # Back to the save, for the checks after (export reads the saved step; the weights are the save's again).
        asyncio.run(self.state.backend.load_checkpoint(1, path))
        return f"max difference {diff:.2g}; the step after the load {apart:.2g} from the step after the save"

    def check_export(self) -> str:
        """export: the saved checkpoint as a Hugging Face folder whose log-probs are the service's at the save."""
        import tempfile

        import torch
        from transformers import AutoModelForCausalLM

        from verl_remote.runtime.export import exports

        backend_class = type(self.state.backend)
        if not exports(backend_class):
            return "not declared (optional): verl-remote export refuses this backend's runs in one line"
        _expect(self.state.saved is not None, "the checkpoint check did not save", "run the checks in order")
        assert self.state.saved is not None
        path, rows, responses, saved = self.state.saved
        out = tempfile.mkdtemp(prefix="export-", dir=self.state.folder)
        backend_class.export(self.state.config, 1, path, out)
        written = os.listdir(out)
        _expect(
            "config.json" in written and any(name.endswith(".safetensors") for name in written),
            f"export wrote {sorted(written)}, not a model folder",
            "write config.json, the tokenizer and *.safetensors (save_pretrained does)",
        )
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        worst = 0.0
        with torch.no_grad():
            for row, response, theirs in zip(rows, responses, _responses_of(saved, rows, responses), strict=True):
                logits = model(input_ids=torch.tensor([row])).logits[0].float()
                start = len(row) - len(response) - 1
                mine = torch.log_softmax(logits[start : len(row) - 1], dim=-1)
                mine = mine.gather(1, torch.tensor(row[start + 1 :])[:, None])[:, 0].numpy()
                worst = max(worst, float(np.abs(mine - theirs).max()))
        _expect(
            worst <= max(self.atol, 1e-4),
            f"the exported model's log-probs differ from the service's at the save by up to {worst:.3g}",
            "export the weights save_checkpoint saved for the step, with the model's own config",
        )
        return f"max difference {worst:.2g}"

    def check_gradient(self) -> str:
        """gradient: the update the backend applies is the one verl's loss asks for (each loss asked, in turn; by
        default each policy loss mode the backend claims).

        verl_remote.testing.gradient says how: from one saved state, the backend's update against the same
        gradient carried by a probe every backend trains alike. A backend that takes its loss from the config
        it is made with (not from each forwarder's) is right in a run, whose configs agree: a loss it fails on
        the checked backend is compared again on a backend made for that loss, and the losses after it too."""
        import ray

        from verl_remote.testing import gradient as g

        path = os.path.join(self.state.folder, "global_step_3", "actor")
        os.makedirs(path)
        rows, responses = self._gradient_rows()
        lengths = [len(r) for r in responses]
        asyncio.run(self.state.backend.save_checkpoint(3, path))
        current = self._log_probs(rows, lengths)
        actor = self.state.config.actor_rollout_ref.actor
        losses, refused = (self.losses, []) if self.losses is not None else self.claimed_losses()
        made: dict[str, tuple[Any, Any]] = {}  # backends made for a loss, and their forwarders, by its settings

        def update(settings: dict[str, Any], batch: tuple[Any, ...], own: bool) -> np.ndarray:
            """The response tokens' log-probs after one update from the saved state by a run with ``settings``:
            through the checked backend's forwarder for them, or (``own``) a backend made with them."""
            backend, worker = self.state.backend, self.state.worker
            if own and settings:
                backend, worker = self._made_for(settings, made)
            asyncio.run(backend.load_checkpoint(3, path))
            ray.get(worker.use_actor.remote({} if own else settings), timeout=600)
            self._update(*batch, worker=worker)
            return np.concatenate(_responses_of(self._log_probs(rows, lengths, worker=worker), rows, responses))

        rtol = self.tolerances.gradient_rtol
        if self.tolerances.probe_on_own_rows:
            # In bf16 a row's log-probs depend on the batch they are computed in: the probe trains on the update's
            # own rows, summed over tokens (so that an aggregation's weights are still the backend's to get right).
            probing = {**g.probe_settings(actor), "loss_agg_mode": "token-sum"}
            probe_actor = g.with_settings(actor, probing)

            def probe(under: g.LossUnderTest, own: bool, gradient: list[np.ndarray]) -> np.ndarray:
                return update(probing, g.own_rows_batch(under, gradient, probe_actor), own)

        else:
            probing = g.probe_settings(actor)
            probe_actor = g.with_settings(actor, probing)
            # The probe's old log-probs as the service scores the probe's own rows: its ratio is exactly 1.
            own_rows, own_responses = g.probe_rows(rows, responses)
            scored = self._log_probs(own_rows, [1] * len(own_rows))
            own_scores = np.concatenate(_responses_of(scored, own_rows, own_responses))

            def probe(under: g.LossUnderTest, own: bool, gradient: list[np.ndarray]) -> np.ndarray:
                *batch, meta = g.probe_batch(rows, responses, own_scores, gradient, len(rows), probe_actor)
                return update(probing, (*batch, meta), own)

        start = np.concatenate(_responses_of(current, rows, responses))

        def compare(settings: dict[str, Any], own: bool) -> tuple[float, str]:
            """How far the backend's update for ``settings`` landed from verl's, as a share of verl's move."""
            under = g.LossUnderTest(settings, g.with_settings(actor, settings), rows, responses, current)
            fields, meta = under.mini_batch()
            landed = update(settings, (rows, responses, fields, [[1] * len(r) for r in responses], meta), own)
            expected = probe(under, own, under.gradient())
            apart, moved = g.apart(landed, expected, start)
            label = g.loss_label(settings, under.actor)
            _expect(moved > 0, f"{label}: an update by verl's gradient moved no log-prob", "apply the gradients")
            if apart > rtol * moved:
                why = g.explain(under, landed, start, rtol, functools.partial(probe, under, own))
                raise CheckFailed(
                    f"{label}: the update is not verl's: the log-probs after it are {apart / moved:.0%} of verl's "
                    f"update away from those after verl's gradient ({self._allowed()}){why}",
                    "apply verl's loss for the forwarder's actor config (self.config.actor, which verl builds "
                    "each run's forwarder with): verl_remote.actor_loss on the service, or "
                    "verl_remote.actor_loss_gradient carried by a loss the service has",
                )
            return apart / moved, label

        worst, worst_label, fixed = 0.0, "", False
        try:
            for number, settings in enumerate(losses, 1):
                began = time.monotonic()
                try:
                    share, label = compare(settings, fixed)
                except CheckFailed:
                    if fixed or not (settings or probing):
                        raise
                    share, label = compare(settings, True)  # its failure there is the backend's
                    fixed = True  # it fixes its loss when it is made: the losses after on backends of their own
                if fixed and settings != probing:  # one loss's backend at a time beside the checked one
                    _release(made.pop(json.dumps(settings, sort_keys=True), None))
                self._progress(
                    f"gradient {number}/{len(losses)}: {label}: within {share:.1%} of verl's move "
                    f"({time.monotonic() - began:.1f} s{', on a backend made for it' if fixed else ''})"
                )
                if share >= worst:
                    worst, worst_label = share, label
        finally:
            for made_for in made.values():
                _release(made_for)
            ray.get(self.state.worker.use_actor.remote({}), timeout=600)
            asyncio.run(self.state.backend.load_checkpoint(3, path))
        within = f"verl's update within {worst:.1%} of its move ({self._allowed()})"
        notes = ""
        if fixed:
            notes += "; the backend takes its loss from the config it is made with: each loss on a backend made for it"
        if refused:
            notes += f"; not claimed (its preflight refuses them): {', '.join(refused)}"
        if len(losses) == 1:
            return f"{worst_label}: {within}{notes}"
        return f"{len(losses)} losses: {within}, the farthest {worst_label}{notes}"

    def _made_for(self, settings: dict[str, Any], made: dict[str, tuple[Any, Any]]) -> tuple[Any, Any]:
        """A backend made from the checked config with ``settings`` on its actor, as a run with that loss makes it,
        and its forwarder re-attached in a Ray worker process of its own (made once per settings, in ``made``)."""

        import ray

        from verl_remote.discovery.registry import load_backend_class
        from verl_remote.integration.handoff import attach as attach_handoff
        from verl_remote.testing import gradient as g
        from verl_remote.testing.hosts import WorkerHost

        key = json.dumps(settings, sort_keys=True)
        if key not in made:
            config = copy.deepcopy(self.state.config)
            config.actor_rollout_ref.actor = g.with_settings(config.actor_rollout_ref.actor, settings)
            backend = load_backend_class(self.name).from_config(config)
            made[key] = (backend, None)
            attach_handoff(config, self.name, backend.reconnect_handle())
            worker = (
                ray.remote(WorkerHost).options(num_cpus=0).remote(self.name, config.actor_rollout_ref, _free_port())
            )
            made[key] = (backend, worker)
            ray.get(worker.pid.remote(), timeout=600)
        return made[key]

    def _progress(self, line: str) -> None:
        if self.on_progress is not None:
            self.on_progress(line)

    def _allowed(self) -> str:
        """How the gradient check compares, and what it allows."""
        rows = ", the probe on the update's own rows" if self.tolerances.probe_on_own_rows else ""
        return f"by the norm{rows}; {self.tolerances.gradient_rtol:.0%} allowed for {self.precision}"

    def check_overlap(self) -> str:
        """overlap: while the trainer updates, the sampler keeps the weights of the last update_weights."""
        if self.state.declines is not None:
            return f"not asked: the backend declines overlapped runs ({self.state.declines})"
        path = os.path.join(self.state.folder, "global_step_2", "actor")
        os.makedirs(path)
        self._sync_weights()
        asyncio.run(self.state.backend.save_checkpoint(2, path))
        trained, responses = self._sample_rows(max_tokens=4)
        self._train_step(trained, responses, self._log_probs(trained, [len(r) for r in responses]))
        # Sampled after the update, before a sync: from the synced weights, which the save holds.
        rows, responses = self._sample_rows(max_tokens=4)
        sampled = self.state.sampled_log_probs
        lengths = [len(r) for r in responses]
        updated = _responses_of(self._log_probs(rows, lengths), rows, responses)
        asyncio.run(self.state.backend.load_checkpoint(2, path))
        synced = _responses_of(self._log_probs(rows, lengths), rows, responses)

        def gap(scores: list[np.ndarray]) -> float:
            return max(float(np.abs(a - np.asarray(b)).max()) for a, b in zip(scores, sampled, strict=True))

        off, live = gap(synced), gap(updated)
        _expect(
            off <= self.atol,
            f"after an update without update_weights the sampler's log-probs differ from the synced weights' by up "
            f"to {off:.3g} (from the updated weights' by {live:.3g})",
            "in an overlapped run (trainer.v1.trainer_mode=remote_async) the sampler samples while the trainer "
            "updates: sample from the weights of the last update_weights (a separate sampling job, a snapshot, a "
            "copy kept when verl_remote.overlapped(main_config)), or return a reason from cannot_overlap",
        )
        return f"max difference {off:.2g} (the update moved them by {live:.2g})"

    def check_destroy(self) -> str:
        """destroy: idempotent, nothing the backend started is left running here, and nothing it made is left on
        its service (what the backend's left_on_service reports)."""
        import ray

        named_before = set(self._named_actors())
        for host in (self.state.worker, self.state.server):
            if host is not None:
                ray.kill(host, no_restart=True)
        self.state.worker = self.state.server = None
        asyncio.run(self.state.backend.destroy())
        asyncio.run(self.state.backend.destroy())
        self._made.discard("backend")
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            left_actors = set(self._named_actors()) & named_before
            left_processes = {p: c for p, c in _children().items() if p not in self._baseline and not _is_ray(c)}
            if not left_actors and not left_processes:
                break
            time.sleep(0.5)
        _expect(not left_actors, f"named actors left: {sorted(left_actors)}", "kill the actors the backend started")
        _expect(
            not left_processes,
            f"processes left: {sorted(left_processes.values())}",
            "stop the processes the backend started",
        )
        left = asyncio.run(self.state.backend.left_on_service())
        _expect(
            not left,
            f"left on the service: {'; '.join(map(str, left or []))}",
            "release in destroy everything the backend made on its service (its jobs, models, sessions)",
        )
        if left is None:
            return "twice, nothing left here; what is left on the service not reported (left_on_service)"
        return "twice, nothing left here nor on the service"

    # -- plumbing -------------------------------------------------------------------------------------

    def _sync_weights(self) -> None:
        """A weight sync as the trainer makes it: the backend's update_weights, then the rollout server told of the
        new weights version (its set_global_steps, which clears what it cached of the old weights)."""
        import ray

        asyncio.run(self.state.backend.update_weights())
        self.state.version += 1
        if self.state.server is not None:
            ray.get(self.state.server.set_global_steps.remote(self.state.version), timeout=600)

    def _log_probs(
        self,
        rows: list[list[int]],
        responses: list[int],
        reference: bool = False,
        temperature: float = 1.0,
        worker: Any = None,
    ) -> np.ndarray:
        import ray

        fields = self._fields(rows, responses)
        worker = self.state.worker if worker is None else worker
        out = ray.get(worker.log_probs.remote(fields, temperature, False, reference), timeout=600)
        return np.asarray(out["log_probs"], dtype=np.float64)

    def _fields(
        self, rows: list[list[int]], responses: list[int], masks: list[list[int]] | None = None
    ) -> dict[str, Any]:
        prompts = [r[: len(r) - n] for r, n in zip(rows, responses, strict=True)]
        answers = [r[len(r) - n :] for r, n in zip(rows, responses, strict=True)]
        return {
            "input_ids": _packed(rows, np.int64),
            "prompts": _packed(prompts, np.int64),
            "responses": _packed(answers, np.int64),
            "response_mask": _packed(masks or [[1] * len(a) for a in answers], np.int64),
        }

    def _gradient_rows(self) -> tuple[list[list[int]], list[list[int]]]:
        """The prompts, each with a response of 1 to 7 tokens (4 on average) of no particular meaning."""
        from verl_remote.testing.gradient import LENGTHS

        rng = np.random.default_rng(1)
        top = max(min(self.state.vocab, 1000), 2)
        prompts = self.state.prompts
        responses = [rng.integers(1, top, size=LENGTHS[i % len(LENGTHS)]).tolist() for i in range(len(prompts))]
        return [p + r for p, r in zip(prompts, responses, strict=True)], responses

    def _update(
        self,
        rows: list[list[int]],
        responses: list[list[int]],
        fields: dict[str, list[list[float]]],
        masks: list[list[int]],
        meta: dict[str, Any],
        *,
        worker: Any = None,
    ) -> None:
        """One forward-backward pass and optimizer step on a mini-batch of these response-aligned fields (through
        ``worker``, a forwarder's host; the checked backend's by default)."""
        import ray

        worker = self.state.worker if worker is None else worker
        batch = self._fields(rows, [len(r) for r in responses], masks)
        batch |= {key: _packed(value, np.float32) for key, value in fields.items()}
        ray.get(worker.forward_backward.remote(batch, meta), timeout=600)
        ray.get(worker.optimizer_step.remote(), timeout=600)

    def _sample_rows(self, max_tokens: int, temperature: float = 1.0) -> tuple[list[list[int]], list[list[int]]]:
        import ray

        params = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "logprobs": True}
        outs = ray.get(
            [self.state.server.sample.remote(p, max_tokens, params, []) for p in self.state.prompts], timeout=600
        )
        responses = [o["token_ids"] for o in outs]
        self.state.sampled_log_probs = [o["log_probs"] for o in outs]
        rows = [p + r for p, r in zip(self.state.prompts, responses, strict=True)]
        return rows, responses

    def _train_step(self, rows: list[list[int]], responses: list[list[int]], log_probs: np.ndarray) -> None:
        """One forward-backward pass and optimizer step on ``rows``, with these as the old log-probs."""
        import ray

        fields, meta = self._mini_batch(rows, responses, log_probs)
        ray.get(self.state.worker.forward_backward.remote(fields, meta), timeout=600)
        ray.get(self.state.worker.optimizer_step.remote(), timeout=600)

    def _mini_batch(
        self, rows: list[list[int]], responses: list[list[int]], log_probs: np.ndarray
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        advantages = [(1.0, -1.0, 0.5)[i % 3] for i in range(len(rows))]
        fields = self._fields(rows, [len(r) for r in responses])
        old = [part.tolist() for part in _responses_of(log_probs, rows, responses)]
        fields["old_log_probs"] = _packed(old, np.float32)
        if self.state.config.actor_rollout_ref.actor.use_kl_loss:
            # The reference's log-probs here (the same numbers at the start): enough to exercise the KL term.
            fields["ref_log_prob"] = _packed(old, np.float32)
        fields["advantages"] = _packed([[a] * len(r) for a, r in zip(advantages, responses, strict=True)], np.float32)
        from verl_remote.testing.gradient import verl_meta

        return fields, verl_meta(sum(len(r) for r in responses), len(rows))

    @staticmethod
    def _named_actors() -> list[str]:
        import ray

        return [f"{a['namespace']}/{a['name']}" for a in ray.util.list_named_actors(all_namespaces=True)]

    # -- running ----------------------------------------------------------------------------------------

    def run(
        self, on_result: Callable[[CheckResult], None] | None = None, *, expected_failures: frozenset[str] = frozenset()
    ) -> list[CheckResult]:
        """Every check in order; after one fails, the rest but ``destroy`` are skipped, unless it is one of
        ``expected_failures`` (declared by the backend's author: the checks after it run)."""
        results: list[CheckResult] = []
        failed = False
        for label, method in CHECKS:
            if failed and method not in ("check_destroy",):
                result = CheckResult(label, ok=False, detail="not run: an earlier check failed", skipped=True)
            elif method == "check_destroy" and "backend" not in self._made:
                result = CheckResult(label, ok=False, detail="not run: no backend was made", skipped=True)
            else:
                start = time.monotonic()
                try:
                    detail = getattr(self, method)()
                    result = CheckResult(label, ok=True, detail=detail)
                except CheckFailed as exc:
                    result = CheckResult(label, ok=False, detail=str(exc), hint=exc.hint)
                except Exception as exc:
                    from verl_remote.kit.errors import one_line

                    result = CheckResult(label, ok=False, detail=one_line(exc))
                result.seconds = time.monotonic() - start
                failed = failed or (not result.ok and label not in expected_failures)
            results.append(result)
            if on_result is not None:
                on_result(result)
        return results

    def close(self) -> None:
        """Destroy what is left (after a failed check) and remove the checkpoint folder."""
        import shutil

        import ray

        for host in (self.state.worker, self.state.server):
            if host is not None:
                with contextlib.suppress(Exception):
                    ray.kill(host, no_restart=True)
        self.state.worker = self.state.server = None
        if "backend" in self._made:
            with contextlib.suppress(Exception):
                asyncio.run(self.state.backend.destroy())
        if self.state.folder:
            shutil.rmtree(self.state.folder, ignore_errors=True)


#: (name, method) in the order they run.
CHECKS: list[tuple[str, str]] = [
    ("spec", "check_spec"),
    ("contract", "check_contract"),
    ("from_config", "check_from_config"),
    ("reconnect_handle", "check_reconnect_handle"),
    ("worker_reattaches", "check_worker_reattaches"),
    ("sampler_reattaches", "check_sampler_reattaches"),
    ("log_prob_layout", "check_log_prob_layout"),
    ("reference", "check_reference"),
    ("sampler", "check_sampler"),
    ("training_step", "check_training_step"),
    ("weight_sync", "check_weight_sync"),
    ("checkpoint", "check_checkpoint"),
    ("export", "check_export"),
    ("gradient", "check_gradient"),
    ("overlap", "check_overlap"),
    ("destroy", "check_destroy"),
]


def _children() -> dict[int, str]:
    """This process's descendants: pid -> command line."""
    from pathlib import Path

    from verl_remote.runtime.watchdog import descendants

    found = {}
    for pid, _start in descendants({os.getpid()}):
        with contextlib.suppress(OSError):
            found[pid] = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    return found


def _is_ray(command: str) -> bool:
    return any(word in command for word in ("ray::", "raylet", "gcs_server", "/ray/", "dashboard", "runtime_env"))


def iter_results(results: list[CheckResult]) -> Iterator[str]:
    for result in results:
        yield result.line()
