"""Hydra search path entries for the installed backends' config groups."""

from __future__ import annotations

import logging
from collections import Counter

from verl_remote.discovery.registry import available_backends
from verl_remote.kit.errors import BackendError

__all__ = ["backend_search_paths"]

log = logging.getLogger(__name__)


def backend_search_paths() -> list[tuple[str, str]]:
    """``(provider, pkg://package)`` for every backend whose spec loads.

    A Hydra plugin cannot fail an app, so broken or ambiguous backends are left
    out with a warning; ``verl-remote list`` and ``doctor`` report them in full.
    """
    installed = available_backends()
    counts = Counter(b.name for b in installed)
    # verl-remote's own configs, for the group files' defaults (verl_remote_launcher/remote.yaml).
    entries: list[tuple[str, str]] = [("verl-remote", "pkg://verl_remote.config")]
    for name in sorted(n for n, count in counts.items() if count > 1):
        log.warning("verl-remote: backend '%s' is registered more than once; run 'verl-remote list'", name)
    for backend in installed:
        if counts[backend.name] > 1:
            continue
        try:
            spec = backend.load_spec()
        except BackendError as exc:
            log.warning("verl-remote: skipping the config group of a broken backend: %s", exc)
            continue
        entries.append((f"verl-remote:{spec.name}", spec.search_path))
    return entries
