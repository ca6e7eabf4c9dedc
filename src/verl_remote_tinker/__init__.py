"""verl-remote-tinker: verl's RL loop on any Tinker-API training and sampling service.

``pip install verl-remote-tinker`` registers the backend ``tinker`` (this distribution's ``verl.remote_backends``
entry point); then ``verl-remote train remote_backend=tinker remote_backend.base_url=http://host:port ...``.
This module holds only the spec, so that finding the backend imports nothing heavy. docs/tinker-backend.md
is the user's page: the mapping of verl's calls onto the Tinker API, every key, what was tested.
"""

from verl_remote import BackendSpec

__version__ = "0.1.0"

SPEC = BackendSpec(
    name="tinker",
    backend="verl_remote_tinker.backend:TinkerBackend",
    worker="verl_remote_tinker.worker:TinkerForwarderWorker",
    rollout="verl_remote_tinker.rollout:TinkerRolloutReplica",
    config_package="verl_remote_tinker",
)
