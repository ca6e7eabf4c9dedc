"""A third party's backend frozen at the verl-remote 0.1.0 contract (the bigram example as 0.1.0 shipped it): never
edited to follow verl-remote (pyproject.toml says why)."""

from verl_remote import BackendSpec

SPEC = BackendSpec(
    name="frozen",
    backend="verl_remote_frozen_backend.backend:BigramBackend",
    worker="verl_remote_frozen_backend.backend:BigramWorker",
    rollout="verl_remote_frozen_backend.backend:BigramReplica",
    config_package="verl_remote_frozen_backend",
)
