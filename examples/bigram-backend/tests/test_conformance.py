"""The backend against verl-remote's conformance checks, one test per check: copy this file into your backend's
tests (with your backend's name, the overrides it needs, and any check it is known to fail declared with why)."""

from verl_remote.testing import parametrize_checks


@parametrize_checks("bigram")
def test_the_bigram_backend(check) -> None:
    check()
