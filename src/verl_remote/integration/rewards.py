"""verl's built-in rewards: the ``data_source`` values its ``default_compute_score`` scores, read from verl's source.

A run whose data names a ``data_source`` that neither the user's reward function nor verl's built-in ones score
fails in verl's reward worker at the first step (``NotImplementedError: Reward function is not implemented for
data_source=...``), after minutes of start-up. Preflight refuses it at once instead; to do so before verl is
imported (``import verl`` imports torch), the names are read from the function's source: the constants it
compares ``data_source`` with (``==``, ``in [...]``) and the prefixes it tests (``data_source.startswith(...)``).
``tests/test_verl_plugin.py`` checks the reading against the installed verl.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from dataclasses import dataclass
from pathlib import Path

__all__ = ["BuiltinRewards", "builtin_rewards"]

#: Where verl defines the function, relative to its package, and its name.
SOURCE = ("utils", "reward_score", "__init__.py")
FUNCTION = "default_compute_score"


@dataclass(frozen=True)
class BuiltinRewards:
    """The ``data_source`` values verl scores without a reward function of the user's."""

    #: In the order verl tests them.
    names: tuple[str, ...]
    prefixes: tuple[str, ...]

    def scores(self, data_source: str) -> bool:
        return data_source in self.names or data_source.startswith(self.prefixes)

    def summary(self, limit: int = 4) -> str:
        """The first few, for a message."""
        shown = [*self.names[:limit], *(f"{prefix}*" for prefix in self.prefixes)]
        more = len(self.names) - min(limit, len(self.names))
        return ", ".join(shown) + (f" and {more} more" if more else "")


def _constants(node: ast.expr) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return [item.value for item in node.elts if isinstance(item, ast.Constant) and isinstance(item.value, str)]
    return []


@functools.cache
def builtin_rewards() -> BuiltinRewards | None:
    """verl's built-in rewards, or None when verl's source does not read as expected (then nothing is refused)."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        path = Path(root).joinpath(*SOURCE)
        if path.is_file():
            break
    else:
        return None
    tree = ast.parse(path.read_text())
    function = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == FUNCTION), None)
    if function is None or not function.args.args or function.args.args[0].arg != "data_source":
        return None
    names: dict[str, None] = {}  # ordered
    prefixes: list[str] = []
    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Name) and node.left.id == "data_source":
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.Eq | ast.In):
                    names.update(dict.fromkeys(_constants(right)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "startswith"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "data_source"
        ):
            for argument in node.args:
                prefixes.extend(_constants(argument))
    if not names:
        return None
    return BuiltinRewards(tuple(names), tuple(prefixes))
