"""Names that moved, kept importable for a minor version with a DeprecationWarning naming the replacement.

verl-remote's face (``verl_remote.__all__``, docs/backend-author-guide.md "What is stable") is its contract with
backend authors. A name that moves or changes keeps working, warning, until the next minor version: the old
module paths (``verl_remote.worker``, ``.rollout``, ``.payload``, ``.compute``, ``.service``: shims beside this
module), the registry functions the face exported (:data:`MOVED_FROM_THE_FACE`), and two methods whose contract
changed (:func:`adapt_requires_single_forwarder`, :func:`adapt_old_sample`).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from typing import Any

__all__ = ["MOVED_FROM_THE_FACE", "REMOVED_IN", "adapt_old_sample", "adapt_requires_single_forwarder", "moved_module"]

#: The release that drops what this module keeps.
REMOVED_IN = "0.2"
#: Names the face exported before 0.1.0, and where they live now.
MOVED_FROM_THE_FACE = {
    name: "verl_remote.discovery.registry"
    for name in (
        "ENTRY_POINT_GROUP",
        "InstalledBackend",
        "available_backends",
        "get_backend_spec",
        "load_backend_class",
        "load_rollout_class",
        "load_worker_class",
    )
}


def _warn(message: str, stacklevel: int) -> None:
    warnings.warn(f"{message}; the old way goes in verl-remote {REMOVED_IN}", DeprecationWarning, stacklevel=stacklevel)


def moved_module(old: str, example: str) -> None:
    """The warning of an old module path, pointing at the importing line."""
    _warn(f"{old} is deprecated: import its names from verl_remote (from verl_remote import {example})", 4)


def moved_from_the_face(name: str) -> Any:
    """A registry name the face used to export, from its new module, with a warning."""
    import importlib

    module = MOVED_FROM_THE_FACE[name]
    _warn(f"verl_remote.{name} is deprecated: import it from {module} (from {module} import {name})", 4)
    return getattr(importlib.import_module(module), name)


def adapt_requires_single_forwarder(cls: Any) -> None:
    """``requires_single_forwarder`` written as a plain method (the contract before 0.1.0) becomes the classmethod the
    contract now asks for, asked of the class (it is answered before any backend exists)."""
    method = cls.__dict__.get("requires_single_forwarder")
    if method is None or isinstance(method, classmethod | staticmethod) or not callable(method):
        return
    _warn(
        f"{cls.__module__}.{cls.__qualname__}.requires_single_forwarder is a plain method: make it a @classmethod "
        "(it is asked before the backend exists)",
        4,
    )
    cls.requires_single_forwarder = classmethod(method)


def adapt_old_sample(cls: Any) -> None:
    """``sample(self, prompt_ids, max_tokens, sampling_params)`` (the contract before 0.1.0, verl's dict) becomes
    ``sample(self, prompt_ids, params)``: the old method is given the budget and the dict it expected."""
    method = cls.__dict__.get("sample")
    if method is None:
        return
    names = list(inspect.signature(method).parameters)
    if names[1:] != ["prompt_ids", "max_tokens", "sampling_params"]:
        return
    _warn(
        f"{cls.__module__}.{cls.__qualname__}.sample(self, prompt_ids, max_tokens, sampling_params) is deprecated: "
        "write sample(self, prompt_ids, params) with params a verl_remote.SamplingParams",
        4,
    )

    @functools.wraps(method)
    async def sample(self: Any, prompt_ids: list[int], params: Any) -> Any:
        sampling_params = {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "repetition_penalty": params.repetition_penalty,
            "logprobs": params.logprobs,
            "stop_token_ids": list(params.stop_token_ids),
        }
        return await method(self, prompt_ids, params.max_tokens, sampling_params)

    cls.sample = sample
