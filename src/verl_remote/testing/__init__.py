"""Conformance checks for any installed backend: ``verl-remote check NAME`` or, in a backend's own tests::

    from verl_remote.testing import check_backend

    def test_my_backend_conforms():
        results = check_backend("my", ["remote_backend.url=http://127.0.0.1:8000"])
        assert all(r.ok for r in results), "\\n".join(r.line() for r in results if not r.ok)

Each check drives the backend the way a training run does (a forwarder worker and a rollout server in their own
Ray processes, re-attached through the reconnect handle) but without verl's trainer, on a Ray instance of its
own, in seconds to a minute on a CPU with the demo's tiny model. See docs/backend-author-guide.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from verl_remote.testing.checks import CHECKS, CheckResult, Conformance

__all__ = ["CHECKS", "CheckResult", "Conformance", "check_backend"]


def check_backend(
    name: str,
    overrides: Sequence[str] = (),
    *,
    on_result: Callable[[CheckResult], None] | None = None,
    atol: float | None = None,
) -> list[CheckResult]:
    """Run every check against backend ``name`` (config ``remote_backend=name`` plus ``overrides``).

    Starts a Ray instance of its own (8 logical CPUs, like a run) unless Ray is running in this process, and
    stops it after; the backend is destroyed however the checks end.
    """
    import ray

    from verl_remote.discovery.compat import quiet_local_ray_auth

    started = not ray.is_initialized()
    if started:
        quiet_local_ray_auth()
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    conformance = Conformance(name, tuple(overrides), **({"atol": atol} if atol is not None else {}))
    try:
        return conformance.run(on_result)
    finally:
        conformance.close()
        if started:
            ray.shutdown()
