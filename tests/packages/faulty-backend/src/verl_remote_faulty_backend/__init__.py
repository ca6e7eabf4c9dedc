from verl_remote import BackendSpec

SPEC = BackendSpec(
    name="faulty",
    backend="verl_remote_faulty_backend.backend:FaultyBackend",
    worker="verl_remote_faulty_backend.backend:FaultyWorker",
    rollout="verl_remote_faulty_backend.backend:FaultyReplica",
    config_package="verl_remote_faulty_backend",
)
