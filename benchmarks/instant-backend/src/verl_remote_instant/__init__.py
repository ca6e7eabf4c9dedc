"""A backend whose service answers at once (benchmarks/client_cost.py): what a run costs is the client's."""

from verl_remote import BackendSpec

SPEC = BackendSpec(
    name="instant",
    backend="verl_remote_instant.backend:InstantBackend",
    worker="verl_remote_instant.backend:InstantWorker",
    rollout="verl_remote_instant.backend:InstantReplica",
    config_package="verl_remote_instant",
)
