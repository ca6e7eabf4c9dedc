"""verl-remote's hook into verl, loaded through verl's own ``verl.plugins`` entry points.

verl imports every module registered in the ``verl.plugins`` group at the end of
``import verl``, in every process that imports it: the CLI and driver, verl's
TaskRunner actor, and each Ray worker. That makes this module the one place
where verl-remote can hook into a process it does not start itself.

Rules for this module (it runs in every verl process, many times):

- cheap: it is part of ``import verl``; ``benchmarks/plugin_import.py`` measures it
  and the target is under 5 ms;
- idempotent: :func:`register` may run any number of times;
- lazy: it registers loader callables and never imports a backend's code;
- quiet on success: verl swallows plugin exceptions at DEBUG level, so anything
  that can fail here must be checkable from ``verl-remote doctor`` instead.

Backends themselves need no registration: any process resolves them by name from
the ``verl.remote_backends`` entry points (see :mod:`verl_remote.registry`). The
trainer mode and rollout replica are registered by
:class:`verl_remote.trainer.RemoteTaskRunner` in the process where verl looks them
up: verl keeps those registries in modules that take about 0.7 s to import,
which this hook must not pay in every process. What this hook does today is mark
the process, so that ``verl-remote doctor`` can tell whether verl loaded it.
"""

from __future__ import annotations

__all__ = ["is_registered", "register"]

_registered = False


def register() -> None:
    """Register verl-remote with verl in this process. Safe to call many times."""
    global _registered
    if _registered:
        return
    _registered = True


def is_registered() -> bool:
    """Whether :func:`register` ran in this process (``verl-remote doctor`` checks it)."""
    return _registered


register()
