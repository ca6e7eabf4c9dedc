"""A minimal backend used by verl-remote's tests; the spec is all this module holds."""

from verl_remote import BackendSpec

SPEC = BackendSpec(
    name="echo",
    backend="verl_remote_echo_backend.backend:EchoBackend",
    worker="verl_remote_echo_backend.worker:EchoWorker",
    rollout="verl_remote_echo_backend.worker:EchoReplica",
    config_package="verl_remote_echo_backend",
)

# Also registered, under the same name, by verl-remote-broken-backend.
TWIN_SPEC = BackendSpec(
    name="twin",
    backend="verl_remote_echo_backend.backend:EchoBackend",
    worker="verl_remote_echo_backend.worker:EchoWorker",
    rollout="verl_remote_echo_backend.worker:EchoReplica",
    config_package="verl_remote_echo_backend",
)
