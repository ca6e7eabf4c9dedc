"""What the CLI diagnoses: the installed backends, without letting one broken backend hide the others (shared by
``verl-remote list``, ``verl-remote doctor`` and doctor's Ray worker task, so that the driver and the workers
judge a backend by the same code), and an environment whose media packages cannot load (doctor, and any command
that fails because of them).
"""

from __future__ import annotations

import importlib
import importlib.resources
import importlib.util
from collections import Counter
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from verl_remote.discovery.registry import (
    InstalledBackend,
    available_backends,
    installed_backend,
    resolve_class,
)
from verl_remote.kit.errors import BackendError, one_line
from verl_remote.kit.spec import BackendSpec

__all__ = ["MEDIA_PACKAGES", "BackendReport", "config_group_error", "inspect_backends", "media_packages_problem"]

#: Packages vLLM's wheels require and text sampling never uses. The package index serves their CUDA builds, which
#: do not load beside a CPU build of torch, and then transformers' model imports fail.
MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
MEDIA_FIX = "pip uninstall -y " + " ".join(MEDIA_PACKAGES)


def media_packages_problem() -> str | None:
    """torchvision, torchaudio or torchcodec installed but unable to load (a CUDA build beside a CPU torch): what
    breaks, in one line with the fix; None when none is installed or each loads."""
    broken = []
    for name in MEDIA_PACKAGES:
        if importlib.util.find_spec(name) is None:
            continue
        try:
            importlib.import_module(name)
        except Exception as exc:  # RuntimeError (an operator missing) or OSError (a library that cannot load)
            broken.append(f"{name} {_version_of(name)} ({type(exc).__name__})")
    if not broken:
        return None
    return (
        f"{', '.join(broken)} cannot load beside torch {_version_of('torch')} (CUDA builds from the package index), "
        f"and then neither can transformers' models nor vLLM; text sampling does not use them: {MEDIA_FIX}"
    )


def _version_of(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "?"


@dataclass(frozen=True)
class BackendReport:
    """What was found for one registration: its spec, or why it is unusable."""

    installed: InstalledBackend
    spec: BackendSpec | None
    error: str | None

    @property
    def ok(self) -> bool:
        return self.error is None


def config_group_error(spec: BackendSpec) -> str | None:
    """Why ``remote_backend/<name>.yaml`` cannot be found in the spec's package, if it cannot."""
    try:
        root = importlib.resources.files(spec.config_package)
    except Exception as exc:  # the package itself is missing or fails to import
        return f"config_package '{spec.config_package}' cannot be imported: {one_line(exc)}"
    group = root.joinpath(spec.config_file)
    if not group.is_file():
        return f"config_package '{spec.config_package}' has no {spec.config_file}"
    import yaml

    try:
        settings = yaml.safe_load(group.read_text())
    except yaml.YAMLError as exc:
        return f"{spec.config_file} in '{spec.config_package}' is not valid YAML: {' '.join(str(exc).split())}"
    name = settings.get("name") if isinstance(settings, dict) else None
    if name != spec.name:
        # config and train refuse it too (compose.py): the group selects the backend by this name.
        return f"{spec.config_file} in '{spec.config_package}' must set 'name: {spec.name}' (it sets {name!r})"
    return None


def _inspect(backend: InstalledBackend, duplicated: bool, classes: bool) -> BackendReport:
    if duplicated:
        try:
            installed_backend(backend.name)
        except BackendError as exc:
            return BackendReport(backend, None, str(exc))
    try:
        spec = backend.load_spec()
    except BackendError as exc:
        return BackendReport(backend, None, str(exc))
    try:
        for role in ("backend", "worker", "rollout") if classes else ():
            resolve_class(backend, spec, role)
    except BackendError as exc:
        return BackendReport(backend, spec, str(exc))
    group_error = config_group_error(spec)
    if group_error is not None:
        return BackendReport(backend, spec, f"backend '{backend.name}': {group_error}")
    return BackendReport(backend, spec, None)


def inspect_backends(*, classes: bool = True) -> list[BackendReport]:
    """Load every installed backend's spec and check its config group file; and import its classes, unless
    ``classes`` is false (``verl-remote list``: a backend's modules may import verl and torch, seconds each)."""
    installed = available_backends()
    counts = Counter(b.name for b in installed)
    return [_inspect(b, counts[b.name] > 1, classes) for b in installed]
