"""An example backend for verl-remote: a bigram model as its own service (see README.md)."""

from verl_remote import BackendSpec

SPEC = BackendSpec(
    name="bigram",
    backend="verl_remote_bigram.backend:BigramBackend",
    worker="verl_remote_bigram.backend:BigramWorker",
    rollout="verl_remote_bigram.backend:BigramReplica",
    config_package="verl_remote_bigram",
)
