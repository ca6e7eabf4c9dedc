"""The contract with backend authors holds across releases: a name that moved or a method whose contract changed keeps
working for a minor version, warning (DeprecationWarning) with its replacement; every module path the docs and the
changelog name imports."""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from typing import Any

import pytest

from conftest import ROOT

#: The module paths of the contract before 0.1.0 (the author guide of 2026-11-30), and a name each held.
OLD_MODULES = {
    "verl_remote.worker": "RemoteForwarderWorker",
    "verl_remote.rollout": "RemoteRolloutServer",
    "verl_remote.payload": "pack_fields",
    "verl_remote.compute": "actor_loss",
    "verl_remote.service": "RayService",
}


@pytest.mark.parametrize(("module", "name"), sorted(OLD_MODULES.items()))
def test_an_old_module_path_imports_warning_with_the_replacement(module: str, name: str) -> None:
    import verl_remote

    sys.modules.pop(module, None)
    with pytest.warns(
        DeprecationWarning, match=rf"{re.escape(module)} is deprecated: import its names from verl_remote"
    ):
        old = importlib.import_module(module)
    assert getattr(old, name) is getattr(verl_remote, name)


def test_the_registry_the_face_exported_is_there_warning() -> None:
    import verl_remote
    from verl_remote.discovery import registry

    for name in ("load_backend_class", "get_backend_spec", "available_backends", "ENTRY_POINT_GROUP"):
        with pytest.warns(DeprecationWarning, match=rf"verl_remote.{name} is deprecated: import it from "):
            assert getattr(verl_remote, name) is getattr(registry, name)
    assert "load_backend_class" not in verl_remote.__all__  # not a stable name
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        verl_remote.no_such_name  # noqa: B018


def test_requires_single_forwarder_as_a_plain_method_still_works_warning() -> None:
    from verl_remote import RemoteBackend

    with pytest.warns(DeprecationWarning, match=r"requires_single_forwarder is a plain method: make it a @classmethod"):

        class Old(RemoteBackend):
            @classmethod
            def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> Any:
                return cls()

            def reconnect_handle(self) -> dict[str, Any]:
                return {}

            async def update_weights(self) -> None: ...
            async def save_checkpoint(self, step: int, path: str) -> None: ...
            async def load_checkpoint(self, step: int, path: str) -> None: ...
            async def destroy(self) -> None: ...

            def requires_single_forwarder(self) -> bool:  # the contract before 0.1.0
                return True

    assert Old.requires_single_forwarder() is True  # asked of the class, before any backend exists


def test_a_rollout_server_with_the_old_sample_signature_is_adapted_warning() -> None:
    import asyncio

    from verl_remote import RemoteRolloutServer, SampleResult, SamplingParams

    with pytest.warns(
        DeprecationWarning, match=r"sample\(self, prompt_ids, max_tokens, sampling_params\) is deprecated"
    ):

        class Old(RemoteRolloutServer):
            async def sample(self, prompt_ids: list[int], max_tokens: int, sampling_params: dict[str, Any]) -> Any:
                return SampleResult([max_tokens, int(sampling_params["top_k"])], None, "completed")

    server = Old.__new__(Old)  # no backend behind it: sample is all this test calls
    params = SamplingParams(max_tokens=5, stop_token_ids=(2,), top_k=7)
    assert asyncio.run(server.sample([1], params)).token_ids == [5, 7]


def test_a_worker_or_rollout_server_method_that_does_not_fit_fails_when_its_class_is_defined() -> None:
    """pluggy-style: an override that drops an argument verl-remote passes, requires one it does not, or is async
    where the base is not (or the reverse) is refused at definition, naming the method and the argument."""
    from verl_remote import RemoteForwarderWorker, RemoteRolloutServer

    with pytest.raises(TypeError, match=r"Wrong.sample: it takes no argument for 'params'; verl-remote calls it as "):

        class Wrong(RemoteRolloutServer):
            async def sample(self, prompt_ids: list[int]) -> Any: ...

    with pytest.raises(TypeError, match=r"Blocking.sample must be 'async def', as RemoteRolloutServer.sample is"):

        class Blocking(RemoteRolloutServer):
            def sample(self, prompt_ids: list[int], params: Any) -> Any: ...

    with pytest.raises(TypeError, match=r"NoMeta.backend_forward_backward: it takes no argument for 'meta'"):

        class NoMeta(RemoteForwarderWorker):
            def backend_forward_backward(self, mini_batch: Any) -> dict[str, float]: ...

    with pytest.raises(TypeError, match=r"NoReference.backend_log_probs: it takes no keyword argument 'reference'"):

        class NoReference(RemoteForwarderWorker):
            def backend_log_probs(self, data: Any, *, temperature: float, calculate_entropy: bool) -> Any: ...

    with pytest.raises(TypeError, match=r"MoreNeeded.backend_optimizer_step: it requires 'scale', which verl-remote"):

        class MoreNeeded(RemoteForwarderWorker):
            def backend_optimizer_step(self, scale: float) -> dict[str, float]: ...

    with pytest.raises(TypeError, match=r"Awaited.backend_optimizer_step must be a plain 'def'"):

        class Awaited(RemoteForwarderWorker):
            async def backend_optimizer_step(self) -> dict[str, float]: ...

    class Fits(RemoteForwarderWorker):  # other names, positional where the base has keywords, **kwargs: all fine
        def backend_log_probs(self, data: Any, temperature: float, calculate_entropy: bool, reference: bool) -> Any: ...
        def backend_forward_backward(self, batch: Any, meta: Any, extra: int = 0) -> dict[str, float]: ...
        def backend_start_profile(self, **kwargs: Any) -> bool: ...


_PATH = re.compile(r"(?<![\w/.-])((?:verl_remote|verl_arctic|verl_remote_tinker)(?:\.[A-Za-z_]\w*)+)")
_FILES = (".yaml", ".yml", ".py", ".md", ".json", ".toml")


def _named_paths() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for doc in [
        ROOT / "CHANGELOG.md",
        ROOT / "README.md",
        ROOT / "CONTRIBUTING.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            for path in _PATH.findall(line):
                if not path.endswith(_FILES):
                    found.setdefault(path, set()).add(f"{doc.relative_to(ROOT)}:{number}")
    return found


def _imports(path: str) -> bool:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def test_every_module_path_the_docs_and_the_changelog_name_imports() -> None:
    named = _named_paths()
    assert len(named) >= 20 and "verl_remote.testing.check_backend" in named
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # an old path a doc names on purpose still imports
        broken = [f"{path} ({', '.join(sorted(where))})" for path, where in sorted(named.items()) if not _imports(path)]
    assert broken == []


def test_the_contract_docs_name_the_deprecated_paths_and_their_replacements() -> None:
    guide = (ROOT / "docs" / "backend-author-guide.md").read_text()
    for module in OLD_MODULES:
        assert f"`{module}`" in guide, module


def test_the_author_guides_table_of_the_face_is_all_of_it_with_each_names_mark() -> None:
    """The face's names and their marks are said once, in the code (``__all__``, ``__stability__``); the guide's
    table of "What is stable" must show every one of them, with its mark, and nothing else of the face's."""
    import verl_remote

    guide = (ROOT / "docs" / "backend-author-guide.md").read_text()
    table = guide[guide.index("| kind | names | stability |") :].split("\n\n", 1)[0]
    shown: dict[str, str] = {}
    for row in table.splitlines()[2:]:
        _, _kind, names, mark, _ = (cell.strip() for cell in row.split("|"))
        assert mark in ("stable", "beta"), row
        for quoted in re.findall(r"`([^`]+)`", names):
            name = quoted.split("(")[0]
            if name.isidentifier() and "." not in name:  # the kit's own paths (verl_remote.testing...) aside
                shown[name] = mark
    # A row may explain a name's methods (RayService's call, the server's sample): nothing else is not the face's.
    assert set(shown) - set(verl_remote.__all__) == {"call", "call_async", "sample"}
    face = {name: shown.get(name) for name in verl_remote.__all__ if name != "__version__"}
    assert face == verl_remote.__stability__
    assert set(verl_remote.__stability__) == set(verl_remote.__all__) - {"__version__"}
