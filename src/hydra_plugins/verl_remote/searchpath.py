"""Hydra search path plugin: every installed backend's config group, in every Hydra app.

Hydra imports every module under the ``hydra_plugins`` namespace package when an
app starts, so this module stays small: it reads entry points and the backends'
specs (import strings only) and never imports a backend's classes. With it,
``remote_backend/<name>.yaml`` shipped in a backend's wheel resolves both from
``verl-remote`` and from ``python -m verl.trainer.main_ppo +remote_backend=<name>``
without any ``hydra.searchpath`` flag.
"""

from __future__ import annotations

import logging

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

log = logging.getLogger(__name__)


class VerlRemoteSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        # Imported here so that Hydra's plugin scan does not pay for it in apps
        # that never build a search path.
        from verl_remote.discovery.search_path import backend_search_paths

        for provider, path in backend_search_paths():
            search_path.append(provider=provider, path=path)
