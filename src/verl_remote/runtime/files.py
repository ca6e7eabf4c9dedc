"""Files a run writes in folders others may share: its own files private, none written through a planted link."""

from __future__ import annotations

import os
from typing import IO

__all__ = ["current_umask", "private_file"]


def current_umask() -> int:
    """The process's umask (read by setting it and setting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def private_file(path: str | os.PathLike[str], mode: str = "a") -> IO[str]:
    """``path`` opened for text (``"a"``: appending, ``"a+"``: reading too), created readable and writable by
    this user only (0600), and refused where the name is a symbolic link (``O_NOFOLLOW``: a link planted at a
    run's log or lock would otherwise send its writes elsewhere)."""
    flags = {"a": os.O_WRONLY, "a+": os.O_RDWR}[mode] | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW
    descriptor = os.open(path, flags, 0o600)
    return os.fdopen(descriptor, mode, encoding="utf-8", errors="replace")
