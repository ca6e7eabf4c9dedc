"""The contract with backend authors: the forms before 0.1.0 are gone, each named with its replacement in the
CHANGELOG's migration note; a method that does not fit is refused when its class is defined; every module path
the docs and the changelog name imports."""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest

from conftest import ROOT

#: The module paths of the contract before 0.1.0 (the author guide of 2026-11-30), gone in 0.1.0: nothing was ever
#: published with them, and the CHANGELOG's migration note says where each name is now.
OLD_MODULES = ("verl_remote.worker", "verl_remote.rollout", "verl_remote.payload", "verl_remote.compute",
               "verl_remote.service")  # fmt: skip


#: The registry's names the face exported before 0.1.0 (now verl_remote.discovery.registry's only).
OFF_THE_FACE = ("load_backend_class", "get_backend_spec", "available_backends", "load_worker_class",
                "load_rollout_class", "InstalledBackend", "ENTRY_POINT_GROUP")  # fmt: skip


def _changelog_migration() -> str:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    start = changelog.index("### Migrating from the contract before 0.1.0")
    return changelog[start:].split("\n### ", 1)[0]


def test_the_contract_before_0_1_is_gone_and_the_migration_note_names_each_form_and_its_replacement() -> None:
    """The old module paths, the registry names the face exported and the old method forms are gone (no shim
    guards a version no user installed); the CHANGELOG's migration note names each, with what to write instead."""
    import verl_remote

    note = _changelog_migration()
    for module in OLD_MODULES:
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(module)
        assert module in note, module
    for name in OFF_THE_FACE:
        with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
            getattr(verl_remote, name)
        assert name in note, name
    assert "verl_remote.discovery.registry" in note
    assert "def requires_single_forwarder(self)" in note and "async def sample(self, prompt_ids, params)" in note


def test_the_old_method_forms_are_refused_when_the_class_is_defined_naming_the_new_one() -> None:
    from verl_remote import RemoteBackend, RemoteRolloutServer

    with pytest.raises(TypeError, match=r"Old.requires_single_forwarder must be a classmethod"):

        class Old(RemoteBackend):
            def requires_single_forwarder(self) -> bool:  # the contract before 0.1.0
                return True

    with pytest.raises(TypeError, match=r"OldServer.sample: it requires 'sampling_params', which verl-remote"):

        class OldServer(RemoteRolloutServer):
            async def sample(self, prompt_ids: list[int], max_tokens: int, sampling_params: dict[str, Any]) -> Any: ...


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
    # The migration note names the paths before 0.1.0 on purpose; nothing else may.
    gone = {
        path: where
        for path, where in named.items()
        if path.startswith(tuple(f"{module}." for module in OLD_MODULES))
        or path in OLD_MODULES
        or path.removeprefix("verl_remote.") in OFF_THE_FACE
    }
    assert all(spot.startswith("CHANGELOG.md:") for where in gone.values() for spot in where), gone
    broken = [
        f"{path} ({', '.join(sorted(where))})"
        for path, where in sorted(named.items())
        if path not in gone and not _imports(path)
    ]
    assert broken == []


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
