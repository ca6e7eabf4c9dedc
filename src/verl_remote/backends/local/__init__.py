"""The embedded ``local`` backend: a Hugging Face causal LM in a Ray actor, on CPU or GPU.

Registered through the same ``verl.remote_backends`` entry point as any
third-party backend (see verl-remote's pyproject.toml).
"""

from verl_remote import BackendSpec

SPEC = BackendSpec(
    name="local",
    backend="verl_remote.backends.local.backend:LocalBackend",
    worker="verl_remote.backends.local.worker:LocalForwarderWorker",
    rollout="verl_remote.backends.local.rollout:LocalRolloutReplica",
    config_package="verl_remote.backends.local",
)
