"""The backend against verl-remote's conformance checks: copy this file into your backend's tests."""

from verl_remote.testing import check_backend


def test_the_bigram_backend_conforms() -> None:
    results = check_backend("bigram")
    failures = [result.line() for result in results if not result.ok]
    assert not failures, "\n".join(failures)
