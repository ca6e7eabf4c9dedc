"""The local backend's sampler: requests batched together sample as each would alone, with log-probs the
training forward gives, and what a step sends at once goes to the engine as a few batches."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf

from verl_remote import SamplingParams
from verl_remote.backends.local.backend import Batches
from verl_remote.backends.local.engine import GenerateResult, LocalEngine, SampleRequest
from verl_remote.demo.assets import ensure_demo_assets
from verl_remote.discovery.compose import compose_config


@pytest.fixture(scope="module")
def engine() -> LocalEngine:
    actor = OmegaConf.to_container(compose_config([], recipe="demo").actor_rollout_ref.actor, resolve=True)
    assert isinstance(actor, dict)
    return LocalEngine(str(ensure_demo_assets().model_path), actor, {"device": "cpu", "seed": 0})


def _request(prompt: list[int], **changes: Any) -> SampleRequest:
    fields: dict[str, Any] = dict(max_tokens=8, temperature=1.0, top_p=1.0, top_k=-1, logprobs=True, stop_token_ids=())
    return SampleRequest(prompt, SamplingParams(**{**fields, **changes}))


def test_a_batch_samples_each_row_with_its_own_parameters_and_the_training_forwards_log_probs(
    engine: LocalEngine,
) -> None:
    greedy = _request([5, 9, 12, 7], temperature=0.0, max_tokens=6)
    requests = [
        greedy,
        _request([3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]),  # the longest prompt: the others are padded to it
        _request([14, 15], max_tokens=3),
        _request([6, 7, 8], top_k=1, max_tokens=5),  # top-k 1 is greedy too
        _request([9, 10, 11, 12], top_p=0.5, logprobs=False),
        _request([4, 4, 4], max_tokens=0),
    ]
    torch.manual_seed(0)
    results = engine.generate_batch(requests)

    assert [len(r.token_ids) for r in results][2:] == [3, 5, 8, 0]
    assert results[4].log_probs is None
    assert all(r.stop_reason == "completed" and r.weights_version == engine.weights_version for r in results)
    # Each row's log-probs are those of a plain forward over its own prompt and response, unpadded.
    engine.model.eval()
    with torch.no_grad():
        for request, result in zip(requests, results, strict=True):
            if not result.token_ids or result.log_probs is None:
                continue
            ids = torch.tensor([request.prompt_ids + result.token_ids])
            scores = torch.log_softmax(engine.model(input_ids=ids).logits[0].float(), dim=-1)
            start = len(request.prompt_ids) - 1
            expected = [float(scores[start + j, token]) for j, token in enumerate(result.token_ids)]
            assert result.log_probs == pytest.approx(expected, abs=1e-5)
    # A greedy row in a batch answers as the same request alone (its log-probs to float rounding); so does top-k 1.
    [alone] = engine.generate_batch([greedy])
    assert alone.token_ids == results[0].token_ids and alone.log_probs == pytest.approx(results[0].log_probs, abs=1e-5)
    assert engine.generate_batch([requests[3]])[0].token_ids == results[3].token_ids


def test_a_row_stops_after_its_first_stop_id_while_the_others_go_on(engine: LocalEngine) -> None:
    prompt = [5, 9, 12, 7]
    [free] = engine.generate_batch([_request(prompt, temperature=0.0)])
    stop = free.token_ids[2]  # the first time it comes may be earlier
    first = free.token_ids.index(stop)
    stopped, going = engine.generate_batch(
        [_request(prompt, temperature=0.0, stop_token_ids=(stop,)), _request(prompt, temperature=0.0)]
    )
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert going.token_ids == free.token_ids and going.log_probs == pytest.approx(free.log_probs, abs=1e-5)


class _Recording:
    """Stands in for the engine actor's handle: records the batches it is sent, answers each at once."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.generate_batch = self

    def remote(self, requests: list[SampleRequest]) -> asyncio.Future[list[GenerateResult]]:
        self.batches.append(len(requests))
        answer: asyncio.Future[list[GenerateResult]] = asyncio.get_running_loop().create_future()
        answer.set_result([GenerateResult(r.prompt_ids[:1], None, "completed", 0) for r in requests])
        return answer


def test_requests_sent_together_go_to_the_engine_as_batches_of_at_most_max_batch() -> None:
    engine = _Recording()
    batches = Batches(engine, max_batch=16)

    async def step() -> list[GenerateResult]:
        return await asyncio.gather(*(batches.submit(_request([i + 3])) for i in range(40)))

    results = asyncio.run(step())
    assert [r.token_ids for r in results] == [[i + 3] for i in range(40)]  # each request gets its own answer
    assert engine.batches == [16, 16, 8]
    # A later step (another event loop, as each asyncio.run) batches again.
    assert len(asyncio.run(step())) == 40 and engine.batches[3:] == [16, 16, 8]


def test_an_engine_error_fails_every_request_of_its_batch() -> None:
    class Failing(_Recording):
        def remote(self, requests: list[SampleRequest]) -> asyncio.Future[list[GenerateResult]]:
            answer: asyncio.Future[list[GenerateResult]] = asyncio.get_running_loop().create_future()
            answer.set_exception(RuntimeError("engine died"))
            return answer

    batches = Batches(Failing(), max_batch=4)

    async def step() -> list[Any]:
        return await asyncio.gather(*(batches.submit(_request([3])) for _ in range(6)), return_exceptions=True)

    outcomes = asyncio.run(step())
    assert len(outcomes) == 6 and all(isinstance(o, RuntimeError) and str(o) == "engine died" for o in outcomes)


def test_the_engines_actor_answers_every_call_of_the_engine() -> None:
    """The engine runs in Ray as ``LocalEngineActor``, a thin class that imports no torch and hands each call to
    the engine: an engine method without its line there would fail only when a run calls it."""
    import inspect

    from verl_remote.backends.local.actor import LocalEngineActor

    def calls(cls: type) -> set[str]:
        return {name for name, member in vars(cls).items() if inspect.isfunction(member) and not name.startswith("_")}

    def parameters(cls: type, name: str) -> list[str]:
        # ray.remote(cls), once run in this process, adds its own _ray_trace_ctx to the class's methods
        return [p for p in inspect.signature(getattr(cls, name)).parameters if p != "_ray_trace_ctx"]

    assert calls(LocalEngine) == calls(LocalEngineActor)
    for name in calls(LocalEngine):
        assert parameters(LocalEngineActor, name) == parameters(LocalEngine, name), name
