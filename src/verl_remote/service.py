"""Deprecated since 0.1.0: ``verl_remote.service``, the module path of names that moved to the face:
RayService, ServiceStartError, resources.

Import them from ``verl_remote`` (``from verl_remote import RayService``); this module goes in 0.2.
"""

from __future__ import annotations

from verl_remote._deprecated import moved_module
from verl_remote.kit.service import RayService, ServiceStartError, resources

moved_module(__name__, "RayService")


__all__ = ["RayService", "ServiceStartError", "resources"]
