"""The rollout server: answers verl's generation requests from the backend, one Ray actor per replica.

verl's agent loops send each generation request to a replica's server actor
(``server.generate(prompt_ids=..., sampling_params=..., request_id=...)``) and
expect verl's ``TokenOutput`` back, tagged with the weights version
(``extra_fields["global_steps"]``). :class:`RemoteRolloutServer` does verl's part of the
contract (token budget, sampling parameters, version tags, the sleep/wake calls
verl makes every step) and leaves one method to a backend:
:meth:`RemoteRolloutServer.sample`. The sampling contract is enforced here, once
for every backend: verl's parameters are parsed with verl's defaults
(:class:`SamplingParams`), and what ``sample`` returns is cut at ``max_tokens``
and after the first stop id, with one log-prob per token when they are asked for. A request that fails with a
transient fault (:func:`~verl_remote.kit.faults.is_transient`: a lost connection, a 502) is sent again, at most
:data:`SAMPLE_ATTEMPTS` times in all: sampling changes nothing on the service, so one 502 costs a retry, not the
step.

This module imports no verl at import time, nor should a backend's module that defines its server class: Ray
imports a server class's module in every process that receives a handle to the server (verl's request balancer,
for one), and verl is seconds of CPU to import. The replica, which verl builds, is
:mod:`verl_remote.integration.rollout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from verl_remote.discovery.registry import load_backend_class
from verl_remote.integration.handoff import read as read_handoff
from verl_remote.kit.backend import RemoteBackend
from verl_remote.kit.errors import one_line
from verl_remote.kit.faults import is_transient
from verl_remote.kit.overrides import check_overrides
from verl_remote.kit.sampling import SampleResult, SamplingParams, within_contract

__all__ = [
    "SAMPLE_ATTEMPTS",
    "SAMPLE_RETRY_WAIT_S",
    "SAMPLE_RETRY_WINDOW_S",
    "RemoteRolloutServer",
]

#: How often one sampling request is sent at most when it fails with a transient fault, and the wait before each
#: further try (doubled each time): a fault that outlasts them fails the request, and the step.
SAMPLE_ATTEMPTS = 3
SAMPLE_RETRY_WAIT_S = 1.0
#: No further try once this long has passed since the first: a fault that takes a request's whole timeout (a
#: service gone silent) is the run's restart's to wait out, not each request's three times over.
SAMPLE_RETRY_WINDOW_S = 60.0

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class RemoteRolloutServer:
    """Runs as an async Ray actor; re-attaches to the backend through its handle."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # one that does not fit fails here, not in a step
        check_overrides(cls, RemoteRolloutServer, ("sample", "sample_group"))

    def __init__(self, rollout_config: Any, model_config: Any, replica_rank: int) -> None:
        self.config = rollout_config
        self.model_config = model_config
        self.replica_rank = replica_rank
        handoff = read_handoff(rollout_config)
        self.backend: RemoteBackend = load_backend_class(handoff.backend).from_config(
            handoff.main_config({"model": model_config}), handle=handoff.handle
        )
        self.global_steps = 0
        self.failures: list[tuple[str, bool]] = []  # each failed request's error in one line, and if transient
        self.retried = 0
        self.inflight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        #: Cleared while an overlapped run's weight sync runs beside its next step: requests that would start
        #: wait for the new weights (:meth:`hold_requests`).
        self.weights_ready = asyncio.Event()
        self.weights_ready.set()
        self.stop_token_ids = model_stop_token_ids(str(model_config.path), lambda: self.tokenizer)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The model's tokenizer, loaded the first time it is used (a server that uses it for every request loads
        it in its ``__init__``: importing transformers is seconds of CPU)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.model_config.path))

    async def ready(self) -> bool:
        return True

    async def set_global_steps(self, global_steps: int) -> None:
        """The training step the sampler's weights now come from: a new one clears what the server cached of the
        weights before (:meth:`clear_kv_cache`, verl's name); then requests held for them go."""
        try:
            if int(global_steps) != self.global_steps:
                await self.clear_kv_cache()
            self.global_steps = int(global_steps)
        finally:  # a failed clear stops the run (the trainer's call fails); nothing is left waiting here
            self.weights_ready.set()

    async def hold_requests(self) -> None:
        """Hold the requests that start from now until :meth:`set_global_steps` (or :meth:`release_requests`):
        the trainer syncs the weights beside its next step, whose samples are to come from the new weights.
        Requests already sampling go on."""
        self.weights_ready.clear()

    async def release_requests(self) -> None:
        """Let held requests go without a new weights version (the sync did not finish)."""
        self.weights_ready.set()

    async def wait_idle(self, timeout_s: float) -> int:
        """Wait until no request is sampling, at most ``timeout_s``; how many still are."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.idle.wait(), timeout_s)
        return self.inflight

    async def take_failures(self) -> list[tuple[str, bool]]:
        """The failed requests since the last call, oldest first: each one's error in one line, and whether it was
        transient (:func:`~verl_remote.kit.faults.is_transient`)."""
        failures, self.failures = self.failures, []
        return failures

    def max_tokens(self, prompt_len: int, sampling_params: dict[str, Any]) -> int:
        """verl's token budget: the response length, capped by prompt+response and the model length."""
        room = int(self.config.max_model_len or (self.config.prompt_length + self.config.response_length)) - prompt_len
        if room < 1:
            raise ValueError(f"prompt of {prompt_len} tokens leaves no room to generate (max_model_len)")
        budget = sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens")
        if budget is None:
            budget = min(
                self.config.response_length, self.config.prompt_length + self.config.response_length - prompt_len
            )
        return max(1, min(int(budget), room))

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **kwargs: Any,
    ) -> Any:
        """verl's ``TokenOutput``: the sampled tokens, their log-probs and the weights versions they came from."""
        if image_data or video_data:
            raise ValueError("verl-remote's rollout replica serves text prompts only")
        return TokenOutputOnArrival(**await self._generated([int(t) for t in prompt_ids], sampling_params))

    async def generate_group(self, prompt_ids: list[int], sampling_params: dict[str, Any], n: int) -> list[Any]:
        """``n`` samples of one prompt in one call, each as :meth:`generate` makes it (as plain dicts of verl's
        ``TokenOutput`` fields): verl-remote's agent loop asks for a prompt's group at once, one Ray call instead of
        ``n``, and the backend samples them with :meth:`sample_group` (one request for the group where the service
        takes one, as verl-remote-tinker's does). A failure fails the group, as one failed sample fails it in verl;
        a transient one sends the group again, as :meth:`generate` sends a sample again."""
        prompt_ids = [int(t) for t in prompt_ids]
        await self.weights_ready.wait()
        first_version = self.global_steps
        self.inflight += n
        self.idle.clear()
        try:
            params = self._params(prompt_ids, sampling_params)
            results = await self._retrying(lambda: self.sample_group_within_contract(prompt_ids, params, n))
        except Exception as exc:  # each of its samples failed, as n requests would have
            self.failures.extend([(one_line(exc), is_transient(exc))] * n)
            raise
        finally:
            self.inflight -= n
            if self.inflight == 0:
                self.idle.set()
        return [self._fields(result, first_version) for result in results]

    def _params(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> SamplingParams:
        return SamplingParams.from_verl(
            sampling_params,
            max_tokens=self.max_tokens(len(prompt_ids), sampling_params),
            stop_token_ids=self.stop_token_ids,
        )

    async def _generated(self, prompt_ids: list[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        """One sample's ``TokenOutput`` fields: its tokens, their log-probs, its stop reason and weights versions."""
        # The weights versions this request may have sampled from: an overlapped run publishes a new one while
        # requests sample (verl's trajectory_staleness metrics read the range).
        await self.weights_ready.wait()
        first_version = self.global_steps
        self.inflight += 1
        self.idle.clear()
        try:
            params = self._params(prompt_ids, sampling_params)
            result = await self._sample_retrying(prompt_ids, params)
        except Exception as exc:
            # verl's agent loop logs the exception and counts the prompt as failed; the trainer asks for the
            # failures after sampling and stops the step with the backend's own words (take_failures).
            self.failures.append((one_line(exc), is_transient(exc)))
            raise
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()
        return self._fields(result, first_version)

    def _fields(self, result: SampleResult, first_version: int) -> dict[str, Any]:
        return {
            "token_ids": result.token_ids,
            "log_probs": result.log_probs,
            "stop_reason": result.stop_reason,
            "extra_fields": {
                "global_steps": self.global_steps,
                "min_global_steps": first_version,
                "max_global_steps": self.global_steps,
            },
        }

    async def _sample_retrying(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        """:meth:`sample_within_contract`, sent again after a transient fault (:data:`SAMPLE_ATTEMPTS`, within
        :data:`SAMPLE_RETRY_WINDOW_S`)."""
        return await self._retrying(lambda: self.sample_within_contract(prompt_ids, params))

    async def _retrying(self, request: Callable[[], Awaitable[_T]]) -> _T:
        """``request()``, sent again after a transient fault (:data:`SAMPLE_ATTEMPTS`, within
        :data:`SAMPLE_RETRY_WINDOW_S`)."""
        began = time.monotonic()
        for attempt in range(SAMPLE_ATTEMPTS):
            try:
                return await request()
            except Exception as exc:
                late = time.monotonic() - began > SAMPLE_RETRY_WINDOW_S
                if attempt + 1 >= SAMPLE_ATTEMPTS or late or not is_transient(exc):
                    raise
                self.retried += 1
                wait_s = SAMPLE_RETRY_WAIT_S * 2**attempt
                log.warning(
                    "verl-remote: a sampling request is sent again in %g s (try %d of %d) after a transient fault: %s",
                    wait_s,
                    attempt + 2,
                    SAMPLE_ATTEMPTS,
                    one_line(exc),
                )
                await asyncio.sleep(wait_s)
        raise AssertionError("unreachable")

    async def take_retried(self) -> int:
        """How many sampling requests were sent again after a transient fault since the last call."""
        retried, self.retried = self.retried, 0
        return retried

    async def sample_within_contract(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        """:meth:`sample`, cut to the contract (:func:`within_contract`): what verl receives."""
        return within_contract(await self.sample(prompt_ids, params), params)

    async def sample_group_within_contract(
        self, prompt_ids: list[int], params: SamplingParams, n: int
    ) -> list[SampleResult]:
        """:meth:`sample_group`, each sample cut to the contract; ``ValueError`` when it answers with another
        number of samples than ``n``."""
        results = list(await self.sample_group(prompt_ids, params, n))
        if len(results) != n:
            raise ValueError(f"{type(self).__name__}.sample_group answered {len(results)} samples, {n} were asked")
        return [within_contract(result, params) for result in results]

    async def sample_group(self, prompt_ids: list[int], params: SamplingParams, n: int) -> list[SampleResult]:
        """``n`` independent samples of one prompt (a GRPO group). Optional: the default calls :meth:`sample` ``n``
        times at once; a service that samples a group in one request (Tinker's ``num_samples``, vLLM's ``n``)
        overrides it to send one."""
        return list(await asyncio.gather(*(self.sample(prompt_ids, params) for _ in range(n))))

    async def sample(self, prompt_ids: list[int], params: SamplingParams) -> SampleResult:
        """Sample one response from the backend; the one method a backend's server implements.

        ``params`` is the request's sampling, parsed (:class:`SamplingParams`):
        ``temperature`` (0: greedy, as in verl's validation), ``top_p``,
        ``top_k``, ``repetition_penalty``, ``logprobs`` (whether one log-prob
        per sampled token is wanted), ``max_tokens`` and ``stop_token_ids`` (the
        model's EOS ids). Pass the budget and the stop ids to the service so it
        stops early; what it returns past either is cut here, so a service that
        only knows its own EOS is fine. ``self.tokenizer`` is the model's
        tokenizer. ``stop_reason`` "aborted" makes verl send the request again
        with the tokens so far appended to the prompt.
        """
        raise NotImplementedError

    # verl calls these on every replica; a backend whose sampler holds memory
    # between steps (a KV cache on the trainer's GPUs) overrides sleep/wake_up.
    # clear_kv_cache also runs when the trainer publishes new weights
    # (set_global_steps): a sampler that caches what it computed of prompts
    # across requests (a prefix cache) drops it there, before the requests
    # held for the new weights go (verl-arctic's resets Arctic's prefix cache).
    async def sleep(self) -> None: ...
    async def wake_up(self, tags: Any = None) -> None: ...
    async def clear_kv_cache(self) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def abort_all_requests(self, reject_request: bool = False) -> None: ...
    async def resume_generation(self) -> None: ...
    async def start_profile(self, **kwargs: Any) -> None: ...
    async def stop_profile(self) -> None: ...


def model_stop_token_ids(model_path: str, tokenizer: Callable[[], Any]) -> list[int]:
    """The model's EOS ids: its tokenizer's, and its generation config's when it has more.

    Read from the model's folder with the ``tokenizers`` library where the folder has a fast tokenizer whose config
    names its EOS token (milliseconds); otherwise (a hub name, a slow tokenizer, a ``special_tokens_map.json``) from
    ``tokenizer()``, transformers' tokenizer of the model (the server's own, loaded once: importing torch and
    transformers is seconds of CPU at a run's start)."""
    folder = Path(model_path)
    eos = _fast_tokenizer_eos_id(folder) if folder.is_dir() else None
    if eos is None:
        eos = tokenizer().eos_token_id
    ids = {eos} if eos is not None else set()
    generation = _generation_eos(folder, model_path)
    if isinstance(generation, int):
        ids.add(generation)
    elif generation:
        ids.update(generation)
    return sorted(int(i) for i in ids)


def _fast_tokenizer_eos_id(folder: Path) -> int | None:
    """The EOS token's id as transformers' tokenizer of this folder has it, where the folder says it plainly:
    ``tokenizer_config.json`` names the token and ``tokenizer.json`` has it (a ``special_tokens_map.json`` may
    rename it: None then, and the caller asks transformers)."""
    config_file, tokenizer_file = folder / "tokenizer_config.json", folder / "tokenizer.json"
    if not (config_file.is_file() and tokenizer_file.is_file()) or (folder / "special_tokens_map.json").exists():
        return None
    token = json.loads(config_file.read_text()).get("eos_token")
    if isinstance(token, dict):  # an AddedToken as transformers writes it
        token = token.get("content")
    if not isinstance(token, str) or not token:
        return None
    from tokenizers import Tokenizer

    found = Tokenizer.from_file(str(tokenizer_file)).token_to_id(token)
    return None if found is None else int(found)


def _generation_eos(folder: Path, model_path: str) -> Any:
    """``eos_token_id`` of the model's generation config (an id, a list of ids or None), as transformers'
    ``GenerationConfig.from_pretrained`` reads it: ``generation_config.json``, none where the model has none."""
    if folder.is_dir():
        file = folder / "generation_config.json"
        return json.loads(file.read_text()).get("eos_token_id") if file.is_file() else None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_path).eos_token_id
    except OSError:
        return None


class TokenOutputOnArrival:
    """verl's ``TokenOutput``, built where it arrives: this process sends its fields, and unpickling them calls
    :func:`token_output`, which builds verl's ``TokenOutput`` in the receiving process (verl's agent loop, which has
    verl imported). So the rollout server's process needs no verl: seconds of CPU at a run's start."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return token_output, (self.fields,)


def token_output(fields: dict[str, Any]) -> Any:
    """verl's ``TokenOutput`` of ``fields`` (what :class:`TokenOutputOnArrival` unpickles to)."""
    from verl.workers.rollout.replica import TokenOutput

    return TokenOutput(**fields)
