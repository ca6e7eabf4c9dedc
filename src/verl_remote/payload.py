"""Deprecated since 0.1.0: ``verl_remote.payload``, the module path of names that moved to the face:
Packed, pack, pack_fields, to_nested, unpack_like.

Import them from ``verl_remote`` (``from verl_remote import Packed``); this module goes in 0.2.
"""

from __future__ import annotations

from verl_remote._deprecated import moved_module
from verl_remote.kit.payload import Packed, pack, pack_fields, to_nested, unpack_like

moved_module(__name__, "Packed")


__all__ = ["Packed", "pack", "pack_fields", "to_nested", "unpack_like"]
