"""verl-remote: run verl's RL loop against a training and sampling service of your own.

This module is the backend author's kit: every name a backend distribution needs is importable from here,
and these names are the stable API (docs/backend-author-guide.md, "What is stable"). The module paths behind
them are not. Finding installed backends is :mod:`verl_remote.discovery.registry`; checking one is
:mod:`verl_remote.testing`.

Its rooms, each importing only the rooms below it (the ``layers`` contract in pyproject.toml is the source;
``nox -s lint`` enforces it, and a test holds this list and docs/architecture.md's to it):

- ``cli``: the ``verl-remote`` command and the driver of a run;
- ``testing``: the conformance kit (``verl-remote check``);
- ``backends``: the embedded local backend, built on this face like any other;
- ``demo``: the built-in demo's assets, and when a command is the demo;
- ``integration``: the seams into verl (plugin, trainer, forwarder workers, rollout replica);
- ``runtime``: what a run needs around verl (checkpoint records, the cluster's paths, the watchdog, the summary);
- ``discovery``: backends, config groups and the composed config, found in any process;
- ``kit``: the contract and helpers authors use, free of verl.

Names load on first use (PEP 562): verl imports ``verl_remote.integration.verl_plugin`` in every process at the
end of ``import verl``, which imports this package, and that must stay cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    # the contract
    "RemoteBackend": "verl_remote.kit.backend",
    "BackendSpec": "verl_remote.kit.spec",
    "SpecError": "verl_remote.kit.errors",
    # the classes verl runs, to subclass (they import verl)
    "RemoteForwarderWorker": "verl_remote.integration.worker",
    "RemoteRolloutReplica": "verl_remote.integration.rollout",
    "RemoteRolloutServer": "verl_remote.integration.server",
    # one sampling request, handed to the rollout server's sample
    "SampleResult": "verl_remote.kit.sampling",
    "SamplingParams": "verl_remote.kit.sampling",
    # the run around the backend
    "as_dict": "verl_remote.kit.config",
    "overlapped": "verl_remote.kit.config",
    "resumes_from_checkpoint": "verl_remote.runtime.checkpoints",
    # a service's address and credentials, as the settings give them
    "read_token": "verl_remote.kit.urls",
    "redacted": "verl_remote.kit.urls",
    "service_url": "verl_remote.kit.urls",
    "token_in_clear": "verl_remote.kit.urls",
    "service_environment": "verl_remote.kit.secrets",
    # tensors on the wire
    "Packed": "verl_remote.kit.payload",
    "pack": "verl_remote.kit.payload",
    "pack_fields": "verl_remote.kit.payload",
    "to_nested": "verl_remote.kit.payload",
    "unpack_like": "verl_remote.kit.payload",
    # verl's computations, where the model lives
    "actor_loss": "verl_remote.kit.compute",
    "actor_loss_gradient": "verl_remote.kit.compute",
    "response_index": "verl_remote.kit.compute",
    "response_values": "verl_remote.kit.compute",
    "sample_token": "verl_remote.kit.compute",
    # a Ray actor as the service
    "RayService": "verl_remote.kit.service",
    "ServiceStartError": "verl_remote.kit.errors",
    "resources": "verl_remote.kit.service",
    # errors
    "BackendError": "verl_remote.kit.errors",
    "BackendImportError": "verl_remote.kit.errors",
    "BackendNotFoundError": "verl_remote.kit.errors",
    "DuplicateBackendError": "verl_remote.kit.errors",
    "one_line": "verl_remote.kit.errors",
    # faults worth another try
    "is_transient": "verl_remote.kit.faults",
    "transient_status": "verl_remote.kit.faults",
}

__all__ = [  # the stable names: docs/backend-author-guide.md, "What is stable"
    "BackendError",
    "BackendImportError",
    "BackendNotFoundError",
    "BackendSpec",
    "DuplicateBackendError",
    "Packed",
    "RayService",
    "RemoteBackend",
    "RemoteForwarderWorker",
    "RemoteRolloutReplica",
    "RemoteRolloutServer",
    "SampleResult",
    "SamplingParams",
    "ServiceStartError",
    "SpecError",
    "__version__",
    "actor_loss",
    "actor_loss_gradient",
    "as_dict",
    "is_transient",
    "one_line",
    "overlapped",
    "pack",
    "pack_fields",
    "read_token",
    "redacted",
    "resources",
    "response_index",
    "response_values",
    "resumes_from_checkpoint",
    "sample_token",
    "service_environment",
    "service_url",
    "to_nested",
    "token_in_clear",
    "transient_status",
    "unpack_like",
]

#: How firm each name of ``__all__`` is (the author guide's "What is stable" shows the same, held by a test).
#: "stable": not removed or changed incompatibly within a minor version, and a name that goes warns for one minor
#: version first. "beta": may change in the next minor version, said in the CHANGELOG: verl's computations on the
#: service side follow how verl's losses reach services (every policy loss, a gradient check), still settling.
__stability__ = {
    name: "beta"
    if name in ("actor_loss", "actor_loss_gradient", "response_index", "response_values", "sample_token", "overlapped")
    else "stable"
    for name in __all__
    if name != "__version__"
}

if TYPE_CHECKING:
    from verl_remote.integration.rollout import RemoteRolloutReplica
    from verl_remote.integration.server import RemoteRolloutServer
    from verl_remote.integration.worker import RemoteForwarderWorker
    from verl_remote.kit.backend import RemoteBackend
    from verl_remote.kit.compute import actor_loss, actor_loss_gradient, response_index, response_values, sample_token
    from verl_remote.kit.config import as_dict, overlapped
    from verl_remote.kit.errors import (
        BackendError,
        BackendImportError,
        BackendNotFoundError,
        DuplicateBackendError,
        one_line,
    )
    from verl_remote.kit.faults import is_transient, transient_status
    from verl_remote.kit.payload import Packed, pack, pack_fields, to_nested, unpack_like
    from verl_remote.kit.sampling import SampleResult, SamplingParams
    from verl_remote.kit.secrets import service_environment
    from verl_remote.kit.service import RayService, ServiceStartError, resources
    from verl_remote.kit.spec import BackendSpec, SpecError
    from verl_remote.kit.urls import read_token, redacted, service_url, token_in_clear
    from verl_remote.runtime.checkpoints import resumes_from_checkpoint


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'verl_remote' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
