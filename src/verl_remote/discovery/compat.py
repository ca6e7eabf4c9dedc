"""Which verl releases verl-remote supports, checked before anything relies on verl's internals.

verl-remote uses public verl seams where they exist and a few private ones where
they do not (listed in :mod:`verl_remote.integration.trainer`); all were checked against
verl 0.9.1. A verl outside this range fails fast with this module's message
instead of deep inside a training step. Also here: what a command does to meet
Ray where Ray's defaults would get in a user's way (:func:`quiet_local_ray_auth`).
"""

from __future__ import annotations

import logging
from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from verl_remote.kit.errors import UnsupportedVerlError

__all__ = [
    "SUPPORTED_VERL",
    "UnsupportedVerlError",
    "quiet_local_ray_auth",
    "require_supported_verl",
    "verl_version_problem",
]

#: The verl releases verl-remote is built and tested against.
SUPPORTED_VERL = SpecifierSet(">=0.9.1,<0.10")


def verl_version_problem() -> str | None:
    """Why the installed verl cannot be used, or None when it can."""
    try:
        installed = version("verl")
    except PackageNotFoundError:
        return f"verl is not installed: pip install 'verl[verl-core]{SUPPORTED_VERL}'"
    if Version(installed) not in SUPPORTED_VERL:
        return (
            f"verl {installed} is not supported by this verl-remote (supported: {SUPPORTED_VERL}); "
            f"install a supported release: pip install 'verl[verl-core]{SUPPORTED_VERL}'"
        )
    return None


def require_supported_verl() -> None:
    problem = verl_version_problem()
    if problem is not None:
        raise UnsupportedVerlError(problem)


def quiet_local_ray_auth() -> None:
    """Before ``ray.init(address="local")``: Ray's own choice of authentication, without its notice.

    Ray 2.60 turns token authentication on for a new local instance when ``RAY_AUTH_MODE`` is unset and logs a
    warning saying so, which ``doctor`` and ``check`` would print among their results. Ray decides as before
    (a token in ``~/.ray/auth_token``, made on first use); only the notice, a warning of the logger of
    ``ray._private.authentication.authentication_token_setup``, is left out. Its errors still show.
    """
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
