"""What a run needs of ``remote_backend.comms`` (:class:`ArcticSettings`), and the server's size checked against
the job configs (:func:`check_server_size`): shared by the backend, every process attaching to a run, and the
export."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_arctic.client import ArcticClient
from verl_remote import as_dict, read_token, service_url

__all__ = ["ArcticSettings", "check_server_size"]


@dataclass(frozen=True)
class ArcticSettings:
    """What a run needs of ``remote_backend.comms``, validated once, in one place (:meth:`of`):
    :meth:`ArcticBackend.preflight` (before Ray), :meth:`ArcticBackend.from_config` (on the driver) and each
    process attaching to the run start from it."""

    url: str
    api: str
    token: str | None
    connect_timeout: float
    read_timeout: float
    retries: int
    launch: str | None
    launch_env: tuple[str, ...]
    startup_timeout: float
    job_ready_timeout: float

    @classmethod
    def of(cls, main_config: Any) -> ArcticSettings:
        """The settings (all a process attaching to a run needs), or ``ValueError`` naming the key to change: a
        transport other than HTTP, a URL that is not http(s) or holds a password, a token variable or file that
        is empty or missing."""
        comms = as_dict(main_config.remote_backend)["comms"]
        if comms.get("protocol", "http") != "http":
            raise ValueError(
                f"remote_backend.comms.protocol={comms.get('protocol')!r} is not supported: verl-arctic talks to "
                "Arctic over HTTP (its Ray transport needs arctic_platform, which pins transformers<5, in verl's "
                "environment)"
            )
        token = read_token(
            "remote_backend.comms.token_env",
            comms.get("token_env"),
            "remote_backend.comms.token_file",
            comms.get("token_file"),
        )
        return cls(
            url=service_url(
                "remote_backend.comms.url",
                comms.get("url"),
                token_setting="remote_backend.comms.token_env (an environment variable) or comms.token_file",
            ),
            api=str(comms.get("api", "auto")),
            token=token,
            connect_timeout=float(comms.get("connect_timeout_s", 10)),
            read_timeout=float(comms.get("read_timeout_s", 1800)),
            retries=int(comms.get("retries", 3)),
            launch=str(comms["launch"]) if comms.get("launch") else None,
            launch_env=_names("remote_backend.comms.launch_env", comms.get("launch_env")),
            startup_timeout=float(comms.get("startup_timeout_s", 300)),
            job_ready_timeout=float(comms.get("job_ready_timeout_s", 1800)),
        )

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.token}"} if self.token else None

    def client(self, generation: str, *, retries: int | None = None) -> ArcticClient:
        """A client of the server, speaking ``generation`` ("auto": the server's, detected)."""
        return ArcticClient(
            self.url,
            generation,
            token=self.token,
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            retries=self.retries if retries is None else retries,
        )


def _names(key: str, value: Any) -> tuple[str, ...]:
    """A list of environment variable names (``comms.launch_env``), or ``ValueError`` naming ``key``."""
    if value is None:
        return ()
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not all(isinstance(n, str) and n.isidentifier() for n in names):
        raise ValueError(
            f"{key}={value!r}: a list of environment variable names, e.g. {key}=[HF_TOKEN], for the credentials "
            "the launched service needs"
        )
    return tuple(names)


def check_server_size(client: ArcticClient, settings: dict[str, Any]) -> None:
    """The GPUs the server was launched with must be the ones the job configs are sized for."""
    status = client.call("status")
    for key in ("training_gpus", "sampling_gpus", "log_prob_gpus"):
        mine, theirs = int(settings.get(key, 1)), status.get(key)
        if theirs is not None and int(theirs) != mine and (key == "training_gpus" or (mine > 0) != (int(theirs) > 0)):
            raise ValueError(
                f"remote_backend.{key}={mine}, but the Arctic server at {client.url} was launched with "
                f"--{key.replace('_', '-')} {theirs}: set remote_backend.{key}={theirs}"
            )
