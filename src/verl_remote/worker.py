"""Deprecated since 0.1.0: ``verl_remote.worker``, the module path of names that moved to the face:
RemoteForwarderWorker.

Import them from ``verl_remote`` (``from verl_remote import RemoteForwarderWorker``); this module goes in 0.2.
"""

from __future__ import annotations

from verl_remote._deprecated import moved_module
from verl_remote.integration.worker import RemoteForwarderWorker

moved_module(__name__, "RemoteForwarderWorker")


__all__ = ["RemoteForwarderWorker"]
