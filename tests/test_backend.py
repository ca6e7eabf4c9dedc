from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from verl_remote import RemoteBackend
from verl_remote.discovery.registry import load_backend_class


def _complete_backend(**overrides: Any) -> type[RemoteBackend]:
    """Define a RemoteBackend subclass, with some methods replaced."""

    async def update_weights(self: Any) -> None:
        pass

    async def save_checkpoint(self: Any, step: int, path: str) -> None:
        pass

    async def load_checkpoint(self: Any, step: int, path: str) -> None:
        pass

    async def destroy(self: Any) -> None:
        pass

    def from_config(cls: Any, main_config: Any, *, handle: dict[str, Any] | None = None) -> Any:
        return cls()

    namespace: dict[str, Any] = {
        "from_config": classmethod(from_config),
        "reconnect_handle": lambda self: {},
        "update_weights": update_weights,
        "save_checkpoint": save_checkpoint,
        "load_checkpoint": load_checkpoint,
        "destroy": destroy,
    }
    namespace.update(overrides)
    return type("Backend", (RemoteBackend,), namespace)


def test_a_complete_backend_can_be_built_and_defaults_to_many_forwarders_and_overlapping() -> None:
    backend = _complete_backend().from_config(None)
    assert backend.requires_single_forwarder() is False
    assert backend.cannot_overlap(OmegaConf.create({})) is None
    assert backend.background_weight_sync is False  # an overlapped run waits for its sync unless it says so


@pytest.mark.parametrize(
    "missing", ["reconnect_handle", "update_weights", "save_checkpoint", "load_checkpoint", "destroy"]
)
def test_every_lifecycle_method_is_abstract(missing: str) -> None:
    cls = _complete_backend()
    namespace = {k: v for k, v in vars(cls).items() if k != missing and not k.startswith("__")}
    incomplete = type("Incomplete", (RemoteBackend,), namespace)
    with pytest.raises(TypeError, match=missing):
        incomplete()


@pytest.mark.parametrize("method", ["update_weights", "save_checkpoint", "load_checkpoint", "destroy"])
def test_sync_override_of_an_async_method_is_rejected_at_definition(method: str) -> None:
    with pytest.raises(TypeError, match=rf"Backend\.{method} must be 'async def'"):
        _complete_backend(**{method: lambda self, *args: None})


@pytest.mark.parametrize("method", ["reconnect_handle"])
def test_async_override_of_a_sync_method_is_rejected_at_definition(method: str) -> None:
    async def coroutine(self: Any) -> Any:
        return {}

    with pytest.raises(TypeError, match=rf"Backend\.{method} must be a plain 'def'"):
        _complete_backend(**{method: coroutine})


@pytest.mark.parametrize("method", ["from_config", "preflight", "requires_single_forwarder", "cannot_overlap"])
def test_what_is_asked_before_the_backend_exists_must_be_a_classmethod(method: str) -> None:
    with pytest.raises(TypeError, match=f"{method} must be a classmethod"):
        _complete_backend(**{method: lambda self, *args, **kwargs: self})

    async def coroutine(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return None

    with pytest.raises(TypeError, match=rf"Backend\.{method} must be a plain 'def'"):
        _complete_backend(**{method: classmethod(coroutine)})


def test_echo_backend_lifecycle_through_a_handle(tmp_path: Path) -> None:
    """The contract as a third-party backend implements it: build, re-attach, sync, checkpoint, destroy."""
    config = OmegaConf.create({"remote_backend": {"name": "echo", "state_dir": str(tmp_path / "state")}})
    cls = load_backend_class("echo")
    driver = cls.from_config(config)
    worker = cls.from_config(config, handle=driver.reconnect_handle())

    async def lifecycle() -> None:
        await worker.update_weights()
        await driver.save_checkpoint(1, str(tmp_path / "ckpt"))
        await worker.update_weights()
        assert driver.state()["weights_version"] == 2  # type: ignore[attr-defined]
        await driver.load_checkpoint(1, str(tmp_path / "ckpt"))
        assert worker.state()["weights_version"] == 1  # type: ignore[attr-defined]
        await driver.destroy()
        await driver.destroy()

    asyncio.run(lifecycle())
    assert worker.state()["destroyed"] is True  # type: ignore[attr-defined]


def test_one_line_is_type_and_message_folded_the_innermost_cause_of_a_ray_error_and_a_tracebacks_last_line() -> None:
    from verl_remote import one_line

    assert one_line(ValueError("bad\n  value   here")) == "ValueError: bad value here"
    assert one_line(TimeoutError()) == "TimeoutError"

    class TaskError(RuntimeError):  # Ray's RayTaskError: the remote exception in `cause`
        def __init__(self, cause: BaseException) -> None:
            super().__init__("Traceback (most recent call last):\n  File ...\nsomething else")
            self.cause = cause

    assert one_line(TaskError(KeyError("job 3"))) == "KeyError: 'job 3'"
    traceback = 'ray::Engine.step()\nTraceback (most recent call last):\n  File "x.py", line 1\nOSError: disk full'
    assert one_line(RuntimeError(traceback)) == "RuntimeError: OSError: disk full"


def test_the_backend_made_beside_verls_start_up_is_the_trainers_or_destroyed_and_its_error_is_raised_there(
    tmp_path: Path, ray_instance: Any
) -> None:
    from verl_remote.discovery.compose import compose_config
    from verl_remote.integration.rollout import discard_server_ahead
    from verl_remote.integration.trainer import BackendStart, RunStopped

    def start(state_dir: Path) -> BackendStart:
        return BackendStart(compose_config(["remote_backend=echo", f"remote_backend.state_dir={state_dir}"]))

    # Taken by the trainer: made, and the trainer's to destroy (the runner's discard leaves it).
    taken = start(tmp_path / "taken")
    backend = taken.take()
    assert backend.state() == {"weights_version": 0, "destroyed": False}  # type: ignore[attr-defined]
    assert taken.discard() is False and not backend.state()["destroyed"]  # type: ignore[attr-defined]
    # verl's start-up failed first, or the run is stopping: destroyed once made, and no trainer takes it after.
    left = start(tmp_path / "left")
    assert left.discard() is True and left.discard() is False
    assert (
        load_backend_class("echo")
        .from_config(  # the state file the backend wrote, read through its handle
            None, handle={"state_file": str(tmp_path / "left" / "state.json")}
        )
        .state()["destroyed"]
    )  # type: ignore[attr-defined]
    with pytest.raises(RunStopped, match="destroyed before the trainer was built"):
        left.take()
    # A backend that cannot be made: its error where the trainer takes it, nothing to destroy.
    (tmp_path / "a-file").write_text("")
    failed = start(tmp_path / "a-file")
    with pytest.raises(OSError):
        failed.take()
    assert start(tmp_path / "a-file").discard() is False
    discard_server_ahead()
    for each in (taken, left, failed):
        each.release()


def test_the_thread_that_made_the_backend_lives_until_the_run_releases_it(
    tmp_path: Path, ray_instance: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What from_config starts may end with the thread that started it (verl-arctic launches a recipe's service with
    Linux's PR_SET_PDEATHSIG): that thread lives until the run is over, as the TaskRunner's did when it made it."""
    import threading

    from verl_remote.discovery.compose import compose_config
    from verl_remote.integration import trainer
    from verl_remote.integration.rollout import discard_server_ahead

    echo = load_backend_class("echo")
    made_in: list[threading.Thread] = []

    class Recorded(echo):  # type: ignore[misc, valid-type]
        @classmethod
        def from_config(cls, main_config: Any, *, handle: dict[str, Any] | None = None) -> Any:
            made_in.append(threading.current_thread())
            return super().from_config(main_config, handle=handle)

    monkeypatch.setattr(trainer, "load_backend_class", lambda name: Recorded)
    start = trainer.BackendStart(compose_config(["remote_backend=echo", f"remote_backend.state_dir={tmp_path}"]))
    start.take()
    discard_server_ahead()
    assert made_in == [start.thread] and made_in[0] is not threading.current_thread()

    def parked() -> bool:
        """Whether the thread waits in BackendStart._run for the event only release() sets: it cannot end before."""
        frame, called = sys._current_frames().get(start.thread.ident or 0), ""
        while frame is not None:
            if frame.f_code is trainer.BackendStart._run.__code__:
                return called == "wait"  # Event.wait: the only wait _run calls is the release's
            called, frame = frame.f_code.co_name, frame.f_back
        return False

    deadline = time.monotonic() + 10
    while not parked():  # it gets there once from_config has returned and the server started ahead
        assert start.thread.is_alive() and time.monotonic() < deadline, "the thread ended without its release"
        time.sleep(0.05)
    start.release()
    start.thread.join(timeout=10)
    assert not start.thread.is_alive()


def test_a_run_that_fails_while_its_backend_is_being_made_leaves_no_backend_and_no_rollout_server(
    ray_instance: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """verl's start-up fails (here: at once) while the local backend's engine still starts: the runner waits for
    the backend, destroys it, and stops the rollout server started ahead with it, which no replica will take."""
    from conftest import live_actors
    from verl_remote.demo import resolve_demo_assets
    from verl_remote.discovery.compose import compose_config
    from verl_remote.integration import trainer

    def fails(self: Any, config: Any) -> None:
        raise RuntimeError("verl's start-up failed")

    monkeypatch.setattr(trainer.TaskRunnerV1.__ray_actor_class__, "run", fails)
    config = compose_config(["remote_backend=local"], recipe="demo")
    resolve_demo_assets(config)
    with pytest.raises(RuntimeError, match="verl's start-up failed"):
        trainer.RemoteTaskRunner().run(config)
    assert live_actors(grace_s=5) == []
