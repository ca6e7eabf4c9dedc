"""Specs broken on purpose; see this distribution's pyproject.toml for which is which."""

from verl_remote import BackendSpec

_GOOD = dict(
    backend="verl_remote_broken_backend.classes:Backend",
    worker="verl_remote_broken_backend.classes:Worker",
    rollout="verl_remote_broken_backend.classes:Replica",
    config_package="verl_remote_broken_backend",
)

MISMATCH_SPEC = BackendSpec(name="other", **_GOOD)
NOT_A_SPEC = {"name": "notaspec"}
BAD_CLASS_SPEC = BackendSpec(name="badclass", **{**_GOOD, "worker": "verl_remote_broken_backend.classes:NoSuchWorker"})
NOT_REMOTE_SPEC = BackendSpec(name="notremote", **{**_GOOD, "backend": "verl_remote_broken_backend.classes:Worker"})
NO_GROUP_SPEC = BackendSpec(name="nogroup", **_GOOD)
NO_NAME_SPEC = BackendSpec(name="noname", **_GOOD)
TWIN_SPEC = BackendSpec(name="twin", **_GOOD)
