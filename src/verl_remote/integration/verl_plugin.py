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
the ``verl.remote_backends`` entry points (see :mod:`verl_remote.discovery.registry`). The
trainer mode (``trainer.v1.trainer_mode=remote``) and the rollout replica
(``actor_rollout_ref.rollout.name=verl_remote``) live in verl modules that take
about 0.7 s to import, which this hook must not pay in every process: it installs
a finder that runs :mod:`verl_remote.integration.verl_hooks` right after verl imports those
modules, in whichever process that happens, so that ``python -m
verl.trainer.main_ppo`` finds them as ``verl-remote train`` does.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["HOOKED_MODULES", "is_registered", "register"]

#: verl module -> the function of :mod:`verl_remote.integration.verl_hooks` to run once it is imported.
HOOKED_MODULES = {
    "verl.trainer.ppo.v1.trainer_base": "on_trainer_base",
    "verl.workers.rollout.replica": "on_rollout_replica",
}

_registered = False


def _run_hook(module: Any) -> None:
    from verl_remote.integration import verl_hooks

    getattr(verl_hooks, HOOKED_MODULES[module.__name__])(module)


class _Loader:
    """Wraps a module's loader: execute the module, then its hook."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        _run_hook(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... as the real loader has them
        return getattr(self._loader, name)


class _PostImportFinder:
    """On ``sys.meta_path``: finds nothing itself, but wraps the loader of a hooked verl module."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in HOOKED_MODULES:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)  # type: ignore[assignment] # a loader by duck typing
                return spec
        return None


def register() -> None:
    """Register verl-remote with verl in this process. Safe to call many times."""
    global _registered
    if _registered:
        return
    _registered = True
    for name in HOOKED_MODULES:
        if name in sys.modules:  # imported before verl loaded its plugins
            _run_hook(sys.modules[name])
    sys.meta_path.insert(0, _PostImportFinder())


def is_registered() -> bool:
    """Whether :func:`register` ran in this process (``verl-remote doctor`` checks it)."""
    return _registered


register()
