"""The Tinker rollout replica; its server, one ``SamplingClient.sample`` a request, is
:mod:`verl_remote_tinker.server`."""

from __future__ import annotations

from typing import ClassVar

from verl_remote import RemoteRolloutReplica, RemoteRolloutServer
from verl_remote_tinker.server import TinkerRolloutServer

__all__ = ["TinkerRolloutReplica", "TinkerRolloutServer"]


class TinkerRolloutReplica(RemoteRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = TinkerRolloutServer
