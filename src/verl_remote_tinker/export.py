"""A run's checkpoint out of a Tinker service as a Hugging Face model folder (:meth:`TinkerBackend.export`).

A checkpoint of this backend is the service's own training state (``save_state``: a ``tinker://`` path, recorded
in ``tinker_checkpoint.json``), which no Tinker route downloads. The export makes a training client from that
state, saves its weights for sampling, and downloads that sampler checkpoint's archive: a PEFT adapter folder
(``adapter_config.json``, ``adapter_model.safetensors``) of the LoRA (SkyRL 0.4.0 ``tx/utils/models.py``
``save_lora_checkpoint``, served at ``GET /api/v1/training_runs/{model}/checkpoints/{id}/archive``, the route
tinker 0.25's ``get_checkpoint_archive_url`` asks; 0.38 no longer has that call, so the route is asked here,
as the SDK asked it). The client is unloaded after.

By default the LoRA is merged into the base model the run trained (``actor_rollout_ref.model.path``, its local
copy): each target's weight gains ``alpha / r * B @ A``, as the service applies it. With ``adapter``, the adapter
folder is written as it came, with the modules it holds named in its ``target_modules`` (the service leaves them
out, and PEFT would otherwise guess them from the model type).
"""

from __future__ import annotations

import asyncio
import json
import os
import tarfile
import tempfile
from typing import Any

import httpx

from verl_remote import one_line

__all__ = ["export_step"]

#: What a sampler checkpoint's archive holds.
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
#: The prefix of every tensor name in the adapter (PEFT's: the LoRA model around the base model).
PREFIX = "base_model.model."


def export_step(settings: dict[str, Any], tinker_path: str, model: Any, step: int, out: str, *, adapter: bool) -> None:
    """The training state at ``tinker_path`` (step ``step`` of a run with ``remote_backend`` ``settings`` and
    ``actor_rollout_ref.model`` ``model``) into the folder ``out``."""
    from transformers import AutoTokenizer

    base = str(model.path)
    with tempfile.TemporaryDirectory(prefix=".tinker-export-", dir=out) as scratch:
        asyncio.run(_download_adapter(settings, tinker_path, step, scratch))
        if adapter:
            _write_adapter(scratch, base, out)
        else:
            _merge(scratch, base, out)
    AutoTokenizer.from_pretrained(str(model.get("tokenizer_path") or base)).save_pretrained(out)


async def _download_adapter(settings: dict[str, Any], tinker_path: str, step: int, scratch: str) -> None:
    """The LoRA of the training state at ``tinker_path``, as the service's sampler checkpoint, into ``scratch``."""
    from verl_remote_tinker import sdk
    from verl_remote_tinker.credentials import api_key
    from verl_remote_tinker.session import retries

    url = str(settings["base_url"]).rstrip("/")
    key = api_key(settings)
    timeout = float(settings["timeout_s"])
    service = await asyncio.to_thread(sdk.service_client, url, key, timeout, retries(settings))
    try:
        try:
            training = await asyncio.wait_for(
                sdk.created(service, "create_training_client_from_state", tinker_path), timeout
            )
        except Exception as exc:
            raise ValueError(
                f"the Tinker service at {url} cannot load the run's checkpoint of step {step} ({tinker_path}): "
                f"{one_line(exc)}; it is no longer there, or the service is another than the run's"
            ) from None
        try:
            saved = await asyncio.wait_for(
                sdk.requested(training, "save_weights_for_sampler", f"export-step-{step}"), timeout
            )
            await asyncio.to_thread(_fetch_archive, url, key, str(saved.path), scratch, timeout)
        finally:
            await sdk.unload(service, str(training.model_id))
    finally:
        await sdk.finish(service)


def _archive_route(sampler_path: str) -> str:
    """The archive route of a sampler checkpoint's ``tinker://`` path: ``tinker://<model>/sampler_weights/<id>``
    (the Tinker service's form) or ``tinker://<model>/<id>`` (SkyRL 0.4.0's answer to save_weights_for_sampler)."""
    parts = sampler_path.removeprefix("tinker://").split("/")
    if not sampler_path.startswith("tinker://") or len(parts) not in (2, 3) or not all(parts):
        raise ValueError(f"the service saved the sampler weights at {sampler_path!r}, not a tinker:// checkpoint path")
    return f"/api/v1/training_runs/{parts[0]}/checkpoints/{parts[-1]}/archive"


def _fetch_archive(url: str, key: str, sampler_path: str, scratch: str, timeout: float) -> None:
    """Download the archive (a redirect to it, or a JSON ``url`` of it) and unpack the adapter's two files."""
    headers = {"X-API-Key": key}
    with httpx.Client(timeout=timeout, headers=headers) as client:
        answer = client.get(f"{url}{_archive_route(sampler_path)}", follow_redirects=False)
        if answer.status_code in (301, 302, 303, 307, 308):
            where = str(answer.headers["location"])
        elif answer.status_code == 200 and answer.headers.get("content-type", "").startswith("application/json"):
            where = str(answer.json()["url"])
        else:
            raise ValueError(
                f"the Tinker service at {url} does not hand out the sampler checkpoint {sampler_path} "
                f"(GET {_archive_route(sampler_path)}: HTTP {answer.status_code}), so the weights cannot be downloaded"
            )
        archive = os.path.join(scratch, "archive.tar.gz")
        with client.stream("GET", httpx.URL(url).join(where), follow_redirects=True) as body, open(archive, "wb") as fp:
            body.raise_for_status()
            for chunk in body.iter_bytes(1 << 20):
                fp.write(chunk)
    with tarfile.open(archive) as tar:
        members = {m.name.removeprefix("./"): m for m in tar.getmembers() if m.isfile()}
        lacking = [name for name in ADAPTER_FILES if name not in members]
        if lacking:
            raise ValueError(f"the sampler checkpoint {sampler_path} holds {sorted(members)}, not {lacking}")
        for name in ADAPTER_FILES:  # only these, by name: nothing in the archive chooses where a file goes
            source = tar.extractfile(members[name])
            assert source is not None
            with open(os.path.join(scratch, name), "wb") as fp:
                fp.write(source.read())
    os.unlink(archive)


def _lora(scratch: str) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The adapter's config and its (A, B) pairs by the base weight's name (``model.layers.0.mlp.up_proj``)."""
    from safetensors.torch import load_file

    with open(os.path.join(scratch, "adapter_config.json")) as fp:
        config = json.load(fp)
    tensors = load_file(os.path.join(scratch, "adapter_model.safetensors"))
    pairs: dict[str, tuple[Any, Any]] = {}
    for name, a in tensors.items():
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix(PREFIX).removesuffix(".lora_A.weight")
            b = tensors.get(f"{PREFIX}{module}.lora_B.weight")
            if b is None:
                raise ValueError(f"the adapter has {name} and no lora_B beside it")
            pairs[module] = (a, b)
    if not pairs:
        raise ValueError(f"the adapter holds no LoRA weights ({sorted(tensors)[:5]})")
    return config, pairs


def _merge(scratch: str, base: str, out: str) -> None:
    """The base model with the adapter merged: ``W + alpha / r * B @ A`` for each target (``A @ B`` for an
    embedding, whose LoRA the service stores untransposed)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    config, pairs = _lora(scratch)
    if config.get("use_rslora") or config.get("use_dora"):
        raise ValueError("the adapter uses rsLoRA or DoRA, which this export does not merge: export it with --adapter")
    scale = float(config["lora_alpha"]) / float(config["r"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    weights = dict(model.named_parameters())
    with torch.no_grad():
        for module, (a, b) in pairs.items():
            weight = weights.get(f"{module}.weight")
            if weight is None:
                raise ValueError(f"the adapter trains {module}, which the base model {base} does not have")
            delta = a.float() @ b.float() if "embed_tokens" in module else b.float() @ a.float()
            if delta.shape != weight.shape:
                raise ValueError(
                    f"the adapter's {module} makes a {tuple(delta.shape)} change of a {tuple(weight.shape)} weight: "
                    f"is {base} the model the run trained?"
                )
            weight += scale * delta
    model.save_pretrained(out, safe_serialization=True)


def _write_adapter(scratch: str, base: str, out: str) -> None:
    """The adapter folder, its config naming the modules it trains and the base model's local copy."""
    import shutil

    config, pairs = _lora(scratch)
    config["target_modules"] = sorted({module.rsplit(".", 1)[-1] for module in pairs})
    config["base_model_name_or_path"] = base
    with open(os.path.join(out, "adapter_config.json"), "w") as fp:
        json.dump(config, fp, indent=2)
    shutil.copy2(os.path.join(scratch, "adapter_model.safetensors"), os.path.join(out, "adapter_model.safetensors"))
