"""The conformance checks as pytest items: one test per check in a backend's own suite.

::

    from verl_remote.testing import parametrize_checks

    @parametrize_checks("my", ["remote_backend.url=http://127.0.0.1:8000"])
    def test_my_backend(check):
        check()

Each check is a test of its own (``test_my_backend[sampler]``, ...), so a failure names the check and the rest
still report. A check the backend is known to fail is declared with its reason,
``expected_failures={"overlap": "our service samples live weights"}``: its failure is reported as expected
(pytest's ``xfail``, with the reason and the check's own line), the checks after it run as if it had passed, and a
declared check that passes fails, so that the declaration goes once it is no longer true. A check that needs one
that failed is skipped, saying so.

The checks drive one backend in order (a sampler is checked on the weights the training step left), so they run
once, together, when the first item asks, and each item reports its own result: keep the items of one call in one
process (pytest-xdist's ``--dist loadfile`` or ``loadscope`` does; ``--dist load`` would run them once per worker).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl_remote.testing.checks import CHECKS, CheckResult

__all__ = ["ConformanceCheck", "parametrize_checks"]

#: The checks' names, in the order they run.
CHECK_NAMES = tuple(label for label, _ in CHECKS)


@dataclass
class _SharedRun:
    """Every check of one backend and config, run once when the first item asks."""

    name: str
    overrides: tuple[str, ...]
    expected: frozenset[str]
    atol: float | None
    losses: Sequence[Mapping[str, Any]] | str | None = None
    results: dict[str, CheckResult] = field(default_factory=dict)

    def result(self, check: str) -> CheckResult:
        if not self.results:
            from verl_remote.testing import check_backend

            results = check_backend(
                self.name, self.overrides, atol=self.atol, expected_failures=self.expected, losses=self.losses
            )
            for result in results:
                self.results[result.name] = result
        return self.results[check]


@dataclass(frozen=True)
class ConformanceCheck:
    """One check of one backend: call it in the test to assert it passed (or failed, as declared)."""

    name: str
    _run: _SharedRun = field(repr=False, compare=False)
    #: Why the backend fails this check, when its author declared it does.
    expected_failure: str | None = None

    def result(self) -> CheckResult:
        return self._run.result(self.name)

    def __call__(self) -> None:
        pytest = _pytest()
        result = self.result()
        if result.skipped:
            pytest.skip(result.detail)
        if self.expected_failure is None:
            assert result.ok, result.line()
        elif result.ok:
            pytest.fail(
                f"{self.name} passed, but it is declared an expected failure ({self.expected_failure}): remove it from "
                "expected_failures"
            )
        else:
            pytest.xfail(f"{self.expected_failure}: {' '.join(result.line().split())}")

    def __str__(self) -> str:
        return self.name


def parametrize_checks(
    name: str,
    overrides: Sequence[str] = (),
    *,
    expected_failures: Mapping[str, str] | None = None,
    atol: float | None = None,
    losses: Sequence[Mapping[str, Any]] | str | None = None,
) -> Callable[[Any], Any]:
    """A ``pytest.mark.parametrize`` over every check of backend ``name`` (config ``remote_backend=name`` plus
    ``overrides``), its argument ``check`` a :class:`ConformanceCheck`; ``expected_failures`` maps a check's name to
    why the backend fails it; ``losses`` as :func:`~verl_remote.testing.check_backend` takes them."""
    pytest = _pytest()
    expected = dict(expected_failures or {})
    unknown = sorted(set(expected) - set(CHECK_NAMES))
    if unknown:
        raise ValueError(
            f"expected_failures names no check: {', '.join(unknown)}; the checks: {', '.join(CHECK_NAMES)}"
        )
    run = _SharedRun(name, tuple(overrides), frozenset(expected), atol, losses)
    params = [pytest.param(ConformanceCheck(label, run, expected.get(label)), id=label) for label in CHECK_NAMES]
    mark: Callable[[Any], Any] = pytest.mark.parametrize("check", params)
    return mark


def _pytest() -> Any:
    """pytest, imported where it is used: an author's suite has it, verl-remote does not depend on it."""
    return importlib.import_module("pytest")
