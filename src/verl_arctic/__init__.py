"""verl-arctic: the Arctic Platform backend for verl-remote.

``pip install verl-arctic`` registers the backend ``arctic`` (see this
distribution's ``verl.remote_backends`` entry point); then
``verl-remote train remote_backend=arctic remote_backend.comms.url=http://host:port ...``.
This module holds only the spec, so that finding the backend imports nothing
heavy. docs/arctic-backend.md is the user's page; docs/arctic-protocol.md the
protocol's.
"""

from verl_remote import BackendSpec

__version__ = "0.1.0"

SPEC = BackendSpec(
    name="arctic",
    backend="verl_arctic.backend:ArcticBackend",
    worker="verl_arctic.worker:ArcticRLActorRolloutRefWorker",
    rollout="verl_arctic.rollout:ArcticRolloutReplica",
    config_package="verl_arctic",
)
