"""Conformance checks for any installed backend: ``verl-remote check NAME`` or, in a backend's own tests, one
test per check (:func:`parametrize_checks`)::

    from verl_remote.testing import parametrize_checks

    @parametrize_checks("my", ["remote_backend.url=http://127.0.0.1:8000"])
    def test_my_backend(check):
        check()

or all of them in one test: ``check_backend("my", [...])`` returns every check's :class:`CheckResult`.

Each check drives the backend the way a training run does (a forwarder worker and a rollout server in their own
Ray processes, re-attached through the reconnect handle) but without verl's trainer, on a Ray instance of its
own, in seconds to a minute on a CPU with the demo's tiny model. See docs/backend-author-guide.md.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from verl_remote.testing.checks import CHECKS, CheckResult, Conformance
from verl_remote.testing.items import ConformanceCheck, parametrize_checks

__all__ = ["CHECKS", "CheckResult", "Conformance", "ConformanceCheck", "check_backend", "parametrize_checks"]


def check_backend(
    name: str,
    overrides: Sequence[str] = (),
    *,
    on_result: Callable[[CheckResult], None] | None = None,
    atol: float | None = None,
    expected_failures: Collection[str] = (),
    losses: Sequence[Mapping[str, Any]] | str | None = None,
    precision: str = "fp32",
    on_progress: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Run every check against backend ``name`` (config ``remote_backend=name`` plus ``overrides``). A check
    named in ``expected_failures`` that fails does not stop the checks after it. ``losses`` are the losses the
    gradient check compares, each as settings of ``actor_rollout_ref.actor`` (dotted keys) on top of the
    config's, or ``"all"``: every policy loss verl has, every aggregation, the KL loss; by default every policy
    loss mode the backend claims (each its preflight accepts, with the configured aggregation and KL term;
    ``[{}]``: the configured loss only); ``on_progress`` is called with a line as each loss is done.
    ``precision``: the one the service computes in, ``"fp32"`` or ``"bf16"``: what the checks allow it
    (:data:`verl_remote.testing.checks.PRECISIONS`; ``atol`` overrides its log-prob tolerance).

    Starts a Ray instance of its own (8 logical CPUs, like a run) unless Ray is running in this process, and
    stops it after; the backend is destroyed however the checks end.
    """
    import ray

    from verl_remote.discovery.compat import quiet_local_ray_auth

    if losses == "all":
        from verl_remote.testing.gradient import every_loss

        losses = every_loss()
    elif isinstance(losses, str):
        raise ValueError(f"losses={losses!r}: give 'all' or a list of settings")
    conformance = Conformance(
        name, tuple(overrides), atol=atol, losses=losses, precision=precision, on_progress=on_progress
    )
    started = not ray.is_initialized()
    if started:
        quiet_local_ray_auth()
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        return conformance.run(on_result, expected_failures=frozenset(expected_failures))
    finally:
        conformance.close()
        if started:
            ray.shutdown()
