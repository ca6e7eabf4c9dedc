"""An override that does not fit the method it overrides is refused when its class is defined, naming the argument.

verl-remote calls a backend's worker and rollout-server methods from its own code, with the arguments their bases
declare. An override that drops one, requires one more, or is ``async`` where the base is not (or the reverse)
would fail at the first call of a run, minutes in, in words about the call site; pluggy refuses such a hook
implementation when it is registered (``_manager.py``, ``_verify_hook``), and so do the bases here, in their
``__init_subclass__``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

__all__ = ["check_overrides"]

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _problem(mine: inspect.Signature, theirs: inspect.Signature) -> str | None:
    """What ``mine`` cannot take of the calls ``theirs`` declares, or None."""
    params = list(mine.parameters.values())
    takes_args = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in _POSITIONAL]
    by_name = {p.name: p for p in params if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
    passed: set[str] = set()
    index = 0
    for expected in theirs.parameters.values():
        if expected.kind in _POSITIONAL:
            if index < len(positional):
                passed.add(positional[index].name)
            elif not takes_args:
                return f"it takes no argument for {expected.name!r}"
            index += 1
        elif expected.kind is inspect.Parameter.KEYWORD_ONLY:
            if expected.name in by_name:
                passed.add(expected.name)
            elif not takes_kwargs:
                return f"it takes no keyword argument {expected.name!r}"
    for param in params:
        required = param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if required and param.name not in passed:
            return f"it requires {param.name!r}, which verl-remote does not pass"
    return None


def check_overrides(cls: type, base: type, methods: Iterable[str]) -> None:
    """Each of ``methods`` that ``cls`` itself defines takes every call ``base`` declares for it, and is
    ``async def`` exactly where the base's is. Raises ``TypeError`` naming the method and the argument."""
    for name in methods:
        mine = cls.__dict__.get(name)
        if mine is None or not callable(mine):
            continue
        theirs: Any = getattr(base, name)
        where = f"{cls.__module__}.{cls.__qualname__}.{name}"
        if inspect.iscoroutinefunction(theirs) and not inspect.iscoroutinefunction(mine):
            raise TypeError(f"{where} must be 'async def', as {base.__qualname__}.{name} is: verl-remote awaits it")
        if inspect.iscoroutinefunction(mine) and not inspect.iscoroutinefunction(theirs):
            raise TypeError(f"{where} must be a plain 'def', as {base.__qualname__}.{name} is: verl-remote calls it")
        expected = inspect.signature(theirs)
        problem = _problem(inspect.signature(mine, follow_wrapped=False), expected)
        if problem is not None:
            raise TypeError(f"{where}: {problem}; verl-remote calls it as {name}{expected}")
