"""Deprecated since 0.1.0: ``verl_remote.compute``, the module path of names that moved to the face:
actor_loss, response_index, response_values, sample_token.

Import them from ``verl_remote`` (``from verl_remote import actor_loss``); this module goes in 0.2.
"""

from __future__ import annotations

from verl_remote._deprecated import moved_module
from verl_remote.kit.compute import actor_loss, response_index, response_values, sample_token

moved_module(__name__, "actor_loss")


__all__ = ["actor_loss", "response_index", "response_values", "sample_token"]
