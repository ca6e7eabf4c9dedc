"""The local backend's rollout replica; its server is :mod:`verl_remote.backends.local.server`."""

from __future__ import annotations

from typing import ClassVar

from verl_remote import RemoteRolloutReplica, RemoteRolloutServer
from verl_remote.backends.local.server import LocalRolloutServer

__all__ = ["LocalRolloutReplica", "LocalRolloutServer"]


class LocalRolloutReplica(RemoteRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = LocalRolloutServer
