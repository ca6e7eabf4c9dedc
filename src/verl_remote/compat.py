"""Which verl releases verl-remote supports, checked before anything relies on verl's internals.

verl-remote uses public verl seams where they exist and a few private ones where
they do not (listed in :mod:`verl_remote.trainer`); all were checked against
verl 0.9.1. A verl outside this range fails fast with this module's message
instead of deep inside a training step.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import Version

__all__ = ["SUPPORTED_VERL", "UnsupportedVerlError", "require_supported_verl", "verl_version_problem"]

#: The verl releases verl-remote is built and tested against.
SUPPORTED_VERL = SpecifierSet(">=0.9.1,<0.10")


class UnsupportedVerlError(RuntimeError):
    """The installed verl is missing or outside :data:`SUPPORTED_VERL`."""


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
