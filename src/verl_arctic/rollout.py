"""The Arctic rollout replica; its server, verl's requests through Arctic's /generate, is :mod:`verl_arctic.server`."""

from __future__ import annotations

from typing import ClassVar

from verl_arctic.server import ArcticRolloutServer, sampled_log_probs
from verl_remote import RemoteRolloutReplica, RemoteRolloutServer

__all__ = ["ArcticRolloutReplica", "ArcticRolloutServer", "sampled_log_probs"]


class ArcticRolloutReplica(RemoteRolloutReplica):
    server_class: ClassVar[type[RemoteRolloutServer]] = ArcticRolloutServer
