"""``verl-remote doctor``: is this environment able to run verl with remote backends?

Each check either passes or fails with a reason the user can act on. The checks
cover what verl itself would hide: verl swallows plugin import errors at DEBUG
level, Hydra plugins cannot fail an app, and a backend that imports in the
driver may still fail in a Ray worker process.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib.metadata import entry_points, version
from typing import Any

from verl_remote.cli.diagnostics import BackendReport, inspect_backends
from verl_remote.discovery.compat import SUPPORTED_VERL, verl_version_problem
from verl_remote.kit.errors import one_line

__all__ = ["Check", "run_checks"]

PLUGIN_MODULE = "verl_remote.integration.verl_plugin"


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str = ""


def check_verl_version() -> Check:
    problem = verl_version_problem()
    if problem is not None:
        return Check("verl version is supported", False, problem)
    return Check("verl version is supported", True, f"verl {version('verl')}, supported: {SUPPORTED_VERL}")


def check_verl_seams() -> Check:
    """The names verl-remote relies on, each against the installed verl (verl_remote.integration.seams)."""
    name = "verl has its V1 trainer and the names verl-remote relies on"
    if verl_version_problem() is not None:
        return Check(name, False, "not checked: the verl version is not supported (above)")
    from verl_remote.integration.seams import SEAMS, verl_problem

    problem = verl_problem()
    if problem is not None:
        return Check(name, False, problem)
    return Check(name, True, f"{len(SEAMS)} names, as verl {version('verl')} has them")


def plugin_status() -> tuple[bool, str]:
    """Whether ``import verl`` loaded verl-remote's plugin in this process, and why not.

    Runs in the driver and, unchanged, in a Ray worker.
    """
    policy = os.environ.get("VERL_USE_EXTERNAL_PLUGINS", "auto").strip().lower()
    if not any(ep.name == "verl_remote" for ep in entry_points(group="verl.plugins")):
        return False, "no 'verl_remote' entry point in group 'verl.plugins': reinstall verl-remote"
    if policy == "none" or (policy != "auto" and "verl_remote" not in {p.strip() for p in policy.split(",")}):
        return False, (
            f"VERL_USE_EXTERNAL_PLUGINS={policy!r} stops verl from loading the plugin: "
            "unset it, or add 'verl_remote' to its list"
        )
    try:
        import verl  # noqa: F401  (loads the plugins)
    except Exception as exc:
        return False, f"import verl failed: {one_line(exc)}"
    module = sys.modules.get(PLUGIN_MODULE)
    if module is not None and module.is_registered():
        return True, f"verl loaded {PLUGIN_MODULE}"
    # verl hid the reason; importing the module here surfaces it.
    try:
        __import__(PLUGIN_MODULE)
    except Exception as exc:
        return False, f"verl could not load {PLUGIN_MODULE}: {one_line(exc)}"
    return False, f"verl did not load {PLUGIN_MODULE}"


def check_vllm() -> Check:
    """The local backend's vLLM sampler: absent is fine (it samples with Hugging Face), broken is named with the fix."""
    from verl_remote.backends.local.vllm_sampler import INSTALL_HINT, vllm_install_problem, vllm_version
    from verl_remote.cli.diagnostics import media_packages_problem

    name = "vLLM (the local backend's remote_backend.sampler=vllm)"
    if vllm_version() is None:
        return Check(name, True, f"not installed, so the local backend samples with Hugging Face: {INSTALL_HINT}")
    problem = media_packages_problem() or vllm_install_problem()  # the media packages first: vLLM imports them
    return Check(name, problem is None, problem or f"{vllm_version()} loads")


def check_plugin() -> Check:
    ok, detail = plugin_status()
    return Check("verl loads the verl-remote plugin", ok, detail)


def check_search_path_plugin() -> Check:
    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    names = [f"{p.__module__}.{p.__name__}" for p in Plugins.instance().discover(SearchPathPlugin)]
    ok = "hydra_plugins.verl_remote.searchpath.VerlRemoteSearchPathPlugin" in names
    detail = "found" if ok else f"not among Hydra's search path plugins {names}: reinstall verl-remote"
    return Check("Hydra finds the verl-remote search path plugin", ok, detail)


def _backend_checks(report: BackendReport) -> Iterator[Check]:
    label = f"backend {report.installed}"
    if not report.ok:
        yield Check(f"{label} loads", False, report.error or "")
        return
    yield Check(f"{label} loads", True, "spec, backend, worker and rollout classes import")
    yield _check_group(report.installed.name)
    from verl_remote.discovery.registry import load_backend_class

    try:
        notes = load_backend_class(report.installed.name).doctor_notes()
    except Exception as exc:
        yield Check(f"{label} says what it reaches", False, f"its doctor_notes() failed: {one_line(exc)}")
        return
    for note in notes:
        yield Check(f"{label} reaches", True, note)


def _check_group(name: str) -> Check:
    """The backend's group composes through verl-remote and through verl's own trainer config."""
    from hydra import compose, initialize_config_module

    from verl_remote.discovery.compose import compose_config

    label = f"backend {name}: config group remote_backend/{name} composes"
    try:
        compose_config([f"remote_backend={name}"])
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            config = compose(config_name="ppo_trainer", overrides=[f"+remote_backend={name}"])
        if config.remote_backend.get("name") != name:
            raise ValueError(
                f"through verl.trainer.main_ppo, remote_backend.name is {config.remote_backend.get('name')!r}"
            )
    except Exception as exc:
        return Check(label, False, one_line(exc))
    return Check(label, True, "with verl-remote's config and with verl's ppo_trainer (+remote_backend)")


def _inspect_in_worker() -> dict[str, Any]:
    """Runs in a Ray worker process: what that process sees."""
    ok, detail = plugin_status()
    return {
        "plugin": (ok, detail),
        "backends": [(str(r.installed), r.error) for r in inspect_backends()],
    }


def check_ray_worker(num_cpus: int = 1) -> list[Check]:
    """Start a local Ray cluster and repeat the plugin and backend checks in a worker process."""
    try:
        import ray
    except Exception as exc:
        return [Check("Ray worker", False, f"import ray failed: {one_line(exc)}")]
    from verl_remote.discovery.compat import quiet_local_ray_auth

    quiet_local_ray_auth()
    try:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    except Exception as exc:
        return [Check("Ray worker", False, f"could not start a local Ray cluster: {one_line(exc)}")]
    try:
        seen = ray.get(ray.remote(num_cpus=1)(_inspect_in_worker).remote(), timeout=300)
    except Exception as exc:
        return [Check("Ray worker", False, f"the worker task failed: {one_line(exc)}")]
    finally:
        ray.shutdown()
    ok, detail = seen["plugin"]
    checks = [Check("Ray worker: verl loads the verl-remote plugin", ok, detail)]
    for label, error in seen["backends"]:
        checks.append(Check(f"Ray worker: backend {label} loads", error is None, error or "resolved by name"))
    return checks


def run_checks(*, ray_worker: bool = True, on_check: Callable[[Check], None] | None = None) -> list[Check]:
    """Run every check in order, reporting each as soon as it is known. What the imports say on the way (verl's
    "No supported accelerator detected" on a CPU machine, its engines' "not available" warnings, the search path
    plugin's word on each broken backend) is left out: the rows say what matters, once each."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _run_checks(ray_worker=ray_worker, on_check=on_check)
    finally:
        logging.disable(logging.NOTSET)


def _run_checks(*, ray_worker: bool, on_check: Callable[[Check], None] | None) -> list[Check]:
    results: list[Check] = []

    def record(check: Check) -> None:
        results.append(check)
        if on_check is not None:
            on_check(check)

    record(check_verl_version())
    record(check_verl_seams())
    record(check_plugin())
    record(check_search_path_plugin())
    reports = inspect_backends()
    if not reports:
        record(Check("backends installed", True, "none yet: pip install a backend distribution"))
    for report in reports:
        for check in _backend_checks(report):
            record(check)
    record(check_vllm())
    if ray_worker:
        for check in check_ray_worker():
            record(check)
    return results
