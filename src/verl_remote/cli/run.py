"""``verl-remote train``: prepare the composed config and run verl's trainer on the backend.

The driver does what verl's ``run_ppo`` does (start Ray with verl's runtime
environment, run the TaskRunner) and two things it cannot: on Ctrl-C it asks the
TaskRunner to destroy the backend before Ray is torn down, and it returns the
run's reward history for the final summary line. The TaskRunner runs in a thread
of the driver, not in an actor of its own as under verl's launcher: the driver
has verl imported already, and a process more would import it again before the
first step (about 7 s on 2 cores). Its environment is the workers' (the runtime
environment's variables).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from verl_remote.demo import resolve_demo_assets
from verl_remote.discovery.compose import ConfigError
from verl_remote.kit.secrets import redact
from verl_remote.runtime.files import private_file
from verl_remote.runtime.summary import RunSummary

__all__ = [
    "RunFolderBusy",
    "RunSummary",
    "Terminated",
    "check_run_folder_free",
    "hold_run_folder",
    "prepare_config",
    "run",
    "wait_before_restart",
]

log = logging.getLogger(__name__)


class Terminated(BaseException):
    """SIGTERM reached the driver (``kill``, systemd, a scheduler): the run stops as on Ctrl-C."""


class RunFolderBusy(ConfigError):
    """Another run holds the checkpoint folder."""


LOCK_FILE = ".verl-remote.lock"


def _holder(handle: Any) -> str:
    handle.seek(0)
    return handle.read().strip() or "another process"


def _busy(folder: str, holder: str) -> RunFolderBusy:
    return RunFolderBusy(
        f"trainer.default_local_dir={folder}: another verl-remote run ({holder}) is using this folder; "
        "wait for it to end, or set trainer.default_local_dir to another folder"
    )


def check_run_folder_free(folder: str) -> None:
    """Refuse at once a folder another run holds, before anything is prepared; reads only (creates nothing).

    :func:`hold_run_folder` takes the folder later and decides: a run may start in between."""
    import fcntl

    try:
        handle = open(os.path.join(os.path.abspath(folder), LOCK_FILE))  # noqa: SIM115 - closed below
    except OSError:
        return  # no run has held it
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _busy(os.path.abspath(folder), _holder(handle)) from None


@contextmanager
def hold_run_folder(folder: str) -> Iterator[None]:
    """Hold ``folder`` for this run: a second run in it is refused, never interleaved.

    An advisory lock on a file in the folder, released when this process ends however it ends (the kernel
    drops the lock of a killed process), so a crashed run never blocks the next one.
    """
    import fcntl

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, LOCK_FILE)
    try:
        handle = private_file(path, "a+")  # held for the whole run; 0600, never through a planted link
    except OSError as exc:
        raise ConfigError(
            f"trainer.default_local_dir={folder}: cannot open the run's lock {path} ({exc.strerror}); a symbolic "
            "link there is not followed: remove it, or give the run a folder of its own"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(handle)
        handle.close()
        raise _busy(folder, holder) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    try:
        yield
    finally:
        handle.close()


def _terminate(signum: int, frame: Any) -> None:
    # Raised as KeyboardInterrupt, the one exception Ray's blocking calls are written to let through;
    # run() turns it into Terminated on the way out.
    global _TERMINATED
    _TERMINATED = True
    raise KeyboardInterrupt


_TERMINATED = False
#: At a run's end, before Ray shuts down: the longest wait for the workers' last lines, and the quiet that ends it
#: sooner (Ray's log monitor reads the workers' files every 0.1 s when they are idle).
LOG_DRAIN_S = 1.5
LOG_QUIET_S = 0.5
#: How long a stopped run's driver waits for its TaskRunner's loop to end, before and after Ray is shut down.
RUNNER_STOP_S = 10.0


#: Keys whose value may be a local path the run's processes read: made absolute against the user's directory.
INPUT_PATHS = (
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "data.train_files",
    "data.val_files",
    "reward.custom_reward_function.path",
)


def _here(value: str) -> bool:
    return "://" not in value and not os.path.isabs(value) and os.path.exists(os.path.expanduser(value))


def prepare_config(config: DictConfig) -> DictConfig:
    """Demo assets, verl's own validation, and the settings verl-remote cannot run without."""
    from verl_remote.discovery.compat import require_supported_verl

    require_supported_verl()
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_remote.integration.names import (
        ASYNC_MODE,
        MODE,
        ROLLOUT_NAME,
        estimator_problem,
        unknown_name_problem,
    )
    from verl_remote.integration.old_log_probs import old_log_probs_problem
    from verl_remote.runtime.record import resume_problem

    if config.get("remote_backend") is None:
        raise ConfigError("no backend selected: add remote_backend=<name> (see 'verl-remote list')")
    if config.trainer.v1.trainer_mode not in (MODE, ASYNC_MODE):
        raise ConfigError(
            f"trainer.v1.trainer_mode must be '{MODE}' (synchronous) or '{ASYNC_MODE}' (the next step samples while "
            f"this one trains) for verl-remote (got {config.trainer.v1.trainer_mode!r})"
        )
    if problem := unknown_name_problem(config) or estimator_problem(config) or old_log_probs_problem(config):
        raise ConfigError(problem)
    if problem := resume_problem(config):
        raise ConfigError(problem)
    if config.actor_rollout_ref.rollout.name != ROLLOUT_NAME:
        raise ConfigError(
            f"actor_rollout_ref.rollout.name must be '{ROLLOUT_NAME}' for verl-remote "
            f"(got {config.actor_rollout_ref.rollout.name!r}): the backend samples the rollouts"
        )
    with open_dict(config):
        # verl resolves these in its TaskRunner process; users mean their own working directory.
        config.trainer.default_local_dir = os.path.abspath(str(config.trainer.default_local_dir))
        if OmegaConf.select(config, "remote_export.out", default=None):
            config.remote_export.out = os.path.abspath(os.path.expanduser(str(config.remote_export.out)))
        for key in INPUT_PATHS:  # a relative path that is there (a hub name such as Qwen/Qwen3-8B is not)
            value = OmegaConf.select(config, key, default=None)
            if isinstance(value, str) and _here(value):
                OmegaConf.update(config, key, os.path.abspath(os.path.expanduser(value)))
            elif OmegaConf.is_list(value):
                OmegaConf.update(config, key, [os.path.abspath(str(v)) if _here(str(v)) else v for v in value])
    from hydra.errors import InstantiationException

    try:
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    except (AssertionError, ValueError) as exc:  # verl's own checks, e.g. batch sizes that do not divide
        raise ConfigError(f"verl rejected the config: {exc}") from exc
    except InstantiationException as exc:  # a check in one of verl's config dataclasses, named by its section
        section = re.search(r"full_key: (\S+)", str(exc))
        where = f" (in {section.group(1)})" if section else ""
        said = " ".join(str(exc.__cause__ or exc).split("full_key:")[0].split())
        raise ConfigError(f"verl rejected the config: {said}{where}") from exc
    from verl_remote.runtime.export import check_export_setting

    check_export_setting(config)
    resolve_demo_assets(config)  # after verl's checks: a refused config makes nothing
    return config


def _ray_init(config: DictConfig) -> None:
    """Start Ray as verl's run_ppo does: its runtime environment, then the config's ray_init kwargs."""
    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    if ray.is_initialized():
        return
    ray_init: dict[str, Any] = dict(OmegaConf.to_container(config.ray_kwargs.get("ray_init", {}), resolve=True))  # type: ignore[arg-type]
    address = ray_init.get("address") or os.environ.get("RAY_ADDRESS")
    if not address or address == "local":
        # Ray would join a cluster someone started on this machine with `ray start`: a run with no address
        # asked for gets its own Ray instance (RAY_ADDRESS=auto joins the machine's cluster).
        ray_init["address"] = "local"
        # Started lean: no dashboard (+ray_kwargs.ray_init.include_dashboard=true asks for it) and no spare
        # workers prestarted for the driver's first job (a run's actors each start a worker of their own): Ray's
        # own processes use half the CPU-seconds (docs/measurements.md, "Start-up, phase by phase").
        ray_init.setdefault("include_dashboard", False)
        os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    else:
        # A cluster that runs already has its resources; Ray refuses them on connect.
        for key in ("num_cpus", "num_gpus"):
            if ray_init.pop(key, None) is not None:
                print(f"verl-remote: joining a running Ray cluster: ray_kwargs.ray_init.{key} is the cluster's")
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(config), ray_init.pop("runtime_env", None) or {})
    # verl's file logger writes relative to its process's directory: make it the user's.
    env_vars = runtime_env.setdefault("env_vars", {})
    env_vars.setdefault("VERL_FILE_LOGGER_ROOT", os.getcwd())
    plain: dict[str, Any] = OmegaConf.to_container(runtime_env)  # type: ignore[assignment]
    env = {str(key): str(value) for key, value in (plain.pop("env_vars", None) or {}).items()}
    rest = {key: value for key, value in plain.items() if value is not None}
    if ray_init.get("address") == "local" and not rest:
        # Ray's own instance, started here: its raylet and every worker inherit this process's environment, so
        # the variables go there, and the workers start with no runtime environment to set up (about 0.5 s
        # less for each of a run's actors; benchmarks/startup.py). The TaskRunner, in this process, sees them.
        os.environ.update(env)
        ray.init(**ray_init)
        return
    ray.init(runtime_env={**plain, "env_vars": env}, **ray_init)
    # The TaskRunner runs here: it sees the variables Ray sets in every worker (a backend's token, say), as an
    # actor of its own would. After Ray's own processes started, which keep the driver's environment.
    os.environ.update(env)


def without_ray_secrets(config: DictConfig) -> DictConfig:
    """A copy of ``config`` for verl's TaskRunner, once Ray runs with the config's ``ray_kwargs``: their secrets
    (``ray_init.runtime_env.env_vars.HF_TOKEN``, say) as ``***``. verl prints the whole config it gets into the
    run's log, and the run records it in its folder; Ray's workers have the values already, and nothing after
    ``ray.init`` reads them from the config."""
    copy = config.copy()
    if copy.get("ray_kwargs") is not None:
        with open_dict(copy):
            copy.ray_kwargs = OmegaConf.create(redact(OmegaConf.to_container(copy.ray_kwargs, resolve=True)))
    return copy


class _RunnerThread(threading.Thread):
    """The TaskRunner's ``run`` in a thread of the driver, whose main thread stays free for Ctrl-C and SIGTERM.

    A daemon: a run stopped mid-step leaves it blocked in a call to a Ray that is shut down, which must not hold
    the interpreter's exit."""

    def __init__(self, runner: Any, config: DictConfig) -> None:
        super().__init__(name="verl_remote_runner", daemon=True)
        self._runner = runner
        self._config = config
        self.summary: RunSummary | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.summary = self._runner.run(self._config)
        except BaseException as exc:  # handed to the main thread, which reports it
            self.error = exc
            # What verl's loop held goes now, while the run's console sorts what it prints: its progress bar,
            # which verl leaves open on an error, prints itself once more when it is collected.
            traceback.clear_frames(exc.__traceback__)

    def result(self) -> RunSummary:
        """Wait for the run (Ctrl-C and SIGTERM reach the waiting main thread), then its summary or its error."""
        while self.is_alive():
            self.join(timeout=1.0)
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary


def _summary_so_far(runner: Any, report: RunSummary) -> None:
    """The summary of a run that did not finish, as far as its trainer came."""
    with contextlib.suppress(Exception):
        report.take(runner.summary())


def run(config: DictConfig, report: RunSummary, *, restarts: int = 0) -> None:
    """Run training to the end; the backend is destroyed on every way out. ``report`` becomes the run's summary,
    as the TaskRunner returns it, or as far as the run came when it stops or fails (while Ray still answers).
    ``restarts``: how often the command restarted the run before (each step logs it)."""
    from verl_remote.runtime.watchdog import start_watchdog

    # Ends what is left of the run once this process is gone, however it goes (SIGKILL included).
    watchdog = start_watchdog()
    try:
        _run(config, report, restarts)
    finally:
        os.close(watchdog)


def wait_before_restart(seconds: float) -> None:
    """Wait ``seconds`` before a restart; Ctrl-C ends the wait (KeyboardInterrupt), and SIGTERM does
    (:class:`Terminated`), with nothing of the run left to stop."""
    previous = signal.signal(signal.SIGTERM, _terminate)
    previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        time.sleep(seconds)
    except KeyboardInterrupt:
        if _TERMINATED:
            raise Terminated(signal.SIGTERM) from None
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)


def _run(config: DictConfig, report: RunSummary, restarts: int) -> None:
    import ray

    from verl_remote.discovery.compat import UnsupportedVerlError
    from verl_remote.integration.seams import verl_problem
    from verl_remote.integration.trainer import RemoteTaskRunner
    from verl_remote.runtime.cluster import check_cluster_paths

    # verl's V1 trainer, whose modules the import above loaded: a verl in range that switched it off or moved its
    # names is named in one line, before Ray starts.
    problem = verl_problem(everything=False)
    if problem is not None:
        raise UnsupportedVerlError(problem)
    _ray_init(config)
    asked = check_cluster_paths(config, LOCK_FILE)
    if asked:
        print(f"verl-remote: the {asked} nodes with CPUs see the run's data, model and folder", flush=True)
    # After Ray's own handler (which exits mid-call and crashes in Ray's C++ teardown): SIGTERM stops the
    # run the way Ctrl-C does.
    previous = signal.signal(signal.SIGTERM, _terminate)
    # A shell starts background jobs with SIGINT ignored, and Python then keeps it so: a run stops on SIGINT
    # however it was started.
    previous_interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)
    thread: _RunnerThread | None = None
    try:
        runner = RemoteTaskRunner()
        runner.restarts = restarts
        thread = _RunnerThread(runner, without_ray_secrets(config))
        thread.start()
        try:
            report.take(thread.result())
        except KeyboardInterrupt:
            # A second signal while the backend shuts down would leave it running: ignore it.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            from verl_remote.cli.console import current_console

            console = current_console()
            if console is not None:  # the workers the stop ends say so in errors: the log has them
                console.stopping()
            what = "terminated (SIGTERM)" if _TERMINATED else "interrupted"
            print(f"\nverl-remote: {what}; destroying the backend ...", file=sys.stderr, flush=True)
            try:
                runner.destroy_backend()  # the loop, mid-step in its thread, makes no further call to it
            except Exception as exc:
                print(f"verl-remote: destroying the backend failed: {exc}", file=sys.stderr)
            _summary_so_far(runner, report)
            if _TERMINATED:
                raise Terminated(signal.SIGTERM) from None
            raise
        except Exception:
            _summary_so_far(runner, report)
            raise
    finally:
        # Ray forwards the workers' output a moment after they write it: their last lines (the backend's
        # shutdown) would be lost to a shutdown right away.
        with contextlib.suppress(KeyboardInterrupt):  # a Ctrl-C now must not skip the shutdown
            if thread is not None:  # a stopped run's loop ends at its next call to the destroyed backend
                thread.join(timeout=RUNNER_STOP_S)
            from verl_remote.cli.console import current_console

            console = current_console()
            if console is not None:
                console.wait_for_quiet(quiet_s=LOG_QUIET_S, at_most_s=LOG_DRAIN_S)
            else:
                time.sleep(LOG_DRAIN_S)
        ray.shutdown()
        if thread is not None:  # what it still waited on fails now: it ends while the console sorts its output
            thread.join(timeout=RUNNER_STOP_S)
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_interrupt)
