"""Deprecated since 0.1.0: ``verl_remote.rollout``, the module path of names that moved to the face:
RemoteRolloutReplica, RemoteRolloutServer, SampleResult, SamplingParams.

Import them from ``verl_remote`` (``from verl_remote import RemoteRolloutReplica``); this module goes in 0.2.
"""

from __future__ import annotations

from verl_remote._deprecated import moved_module
from verl_remote.integration.rollout import RemoteRolloutReplica, RemoteRolloutServer, SampleResult, SamplingParams

moved_module(__name__, "RemoteRolloutReplica")


__all__ = ["RemoteRolloutReplica", "RemoteRolloutServer", "SampleResult", "SamplingParams"]
