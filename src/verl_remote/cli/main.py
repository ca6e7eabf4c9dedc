"""The ``verl-remote`` command line.

Commands import what they need when they run, so ``verl-remote --help`` and
``verl-remote list`` stay fast. Errors a user can fix are printed as one line
on stderr with a non-zero exit; ``--traceback`` shows the full stack.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from verl_remote import __version__
from verl_remote.kit.errors import BackendError, one_line
from verl_remote.runtime.summary import RunSummary

if TYPE_CHECKING:
    from verl_remote.cli.console import Console

__all__ = ["main"]

EXIT_FAILED = 1  # a check or a backend failed
EXIT_USAGE = 2  # bad input: unknown backend, bad override, missing file
EXIT_INTERRUPTED = 130  # Ctrl-C, as shells report it
EXIT_TERMINATED = 143  # SIGTERM, as shells report it


def _cmd_list(args: argparse.Namespace) -> int:
    from verl_remote.cli.diagnostics import inspect_backends

    reports = inspect_backends(classes=False)  # entry points and config groups: a second; doctor imports classes
    if not reports:
        print("no backends installed (install a distribution that registers 'verl.remote_backends')")
        return 0
    rows = []
    for r in reports:
        b = r.installed
        if r.ok and r.spec is not None:
            rows.append((b.name, f"{b.distribution} {b.version}", f"{r.spec.search_path}/{r.spec.config_file}", "ok"))
        else:
            rows.append((b.name, f"{b.distribution} {b.version}", "-", f"error: {r.error}"))
    header = ("NAME", "DISTRIBUTION", "CONFIG GROUP", "STATUS")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3])
    return 0 if all(r.ok for r in reports) else EXIT_FAILED


def _cmd_config(args: argparse.Namespace) -> int:
    from omegaconf import OmegaConf

    from verl_remote.cli.inputs import demo_recipe_problem
    from verl_remote.demo import recipe_for
    from verl_remote.discovery.compose import ConfigError, compose_config
    from verl_remote.kit.secrets import redact

    recipe = recipe_for(args.overrides, args.recipe)
    config = compose_config(args.overrides, recipe=recipe)
    if problem := demo_recipe_problem(recipe, config):
        raise ConfigError(problem)
    if args.as_overrides:
        from verl_remote.cli.preflight import leaves
        from verl_remote.demo import resolve_demo_assets
        from verl_remote.discovery.compose import verl_overrides
        from verl_remote.kit.urls import redacted

        for key, value in list(leaves(config)):  # a password in a URL is not printed (a run refuses it anyway)
            if isinstance(value, str) and "://" in value and "@" in value:
                OmegaConf.update(config, key, redacted(value), merge=False)

        with _quiet_stdout():  # only the overrides on stdout, for $(verl-remote config --overrides)
            resolve_demo_assets(config)
        name = config.remote_backend.name if config.get("remote_backend") is not None else None
        group = compose_config([f"remote_backend={name}"]).remote_backend if name else None
        print("\n".join(verl_overrides(config, group)))
        return 0
    # Shown as it will be used (resolved, where asked), then with every secret's value and a URL's password as
    # ***: an ${oc.env:...} interpolation is a secret only once resolved.
    shown = redact(OmegaConf.to_container(config, resolve=args.resolve))
    print(OmegaConf.to_yaml(OmegaConf.create(shown)), end="")
    return 0


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    with contextlib.redirect_stdout(sys.stderr):
        yield


def _cmd_train(args: argparse.Namespace) -> int:
    from verl_remote.cli.console import run_console

    # First, so that what importing verl and Ray prints is sorted too.
    with run_console(args.verbose) as console:
        return _train(args, console)


def _train(args: argparse.Namespace, console: Console) -> int:
    import copy
    import time
    from pathlib import Path

    # TransferQueue sets torch's threads to TQ_NUM_THREADS (8) around each put and get, capped at the machine's
    # physical cores with a warning each time: several hundred lines a step on a small machine, each forwarded
    # by Ray and sorted by the console. The same number, set before TransferQueue is imported here or in a
    # worker of the run's own Ray instance (which inherits this environment), warns nowhere.
    import psutil

    os.environ.setdefault("TQ_NUM_THREADS", str(max(1, min(8, psutil.cpu_count(logical=False) or 1))))

    from verl_remote.cli.inputs import check_inputs, demo_recipe_problem
    from verl_remote.cli.preflight import check_numbers, probe_service, run_preflight
    from verl_remote.cli.run import (
        Terminated,
        check_run_folder_free,
        hold_run_folder,
        prepare_config,
        run,
        wait_before_restart,
    )
    from verl_remote.demo import recipe_for
    from verl_remote.discovery.compat import UnsupportedVerlError
    from verl_remote.discovery.compose import ConfigError, compose_config
    from verl_remote.discovery.registry import load_backend_class
    from verl_remote.runtime.restarts import Restarts, resumed_config

    recipe = recipe_for(args.overrides, args.recipe)  # the demo's settings only for the demo
    composed = compose_config(args.overrides, recipe=recipe)
    backend_group = composed.get("remote_backend")
    defaults = None
    if backend_group is not None:  # without one, prepare_config says how to choose it
        defaults = compose_config([f"remote_backend={backend_group.name}"], recipe=recipe)
        check_numbers(composed, defaults)  # before the config is prepared: a refused run makes nothing
    # Likewise the model, data and reward; verl's defaults are named as such in a run that is not the demo.
    mixed = check_inputs(composed, defaults if recipe is None else None)
    if problem := demo_recipe_problem(recipe, composed):  # nor through a recipe, with data of the user's own
        raise ConfigError(problem)
    check_run_folder_free(str(composed.trainer.default_local_dir))  # likewise, a run in the folder
    if backend_group is not None:  # a service that does not answer, before verl is imported (seconds)
        probe_service(composed, load_backend_class(str(backend_group.name)).probe_service)
    config = prepare_config(composed)
    backend = load_backend_class(str(config.remote_backend.name))
    checked = run_preflight(
        config, backend.preflight, single_forwarder=backend.requires_single_forwarder(), verl_lora=backend.verl_lora
    )
    for note in mixed + checked:
        print(f"verl-remote: {note}", flush=True)
    folder = str(config.trainer.default_local_dir)
    with hold_run_folder(folder):  # another run there: exit 2
        console.open_log(Path(folder) / "logs" / f"train-{time.strftime('%Y%m%d-%H%M%S')}.log")
        if config.trainer.total_training_steps is not None:  # verl's progress bar says it again
            console.total_steps = int(config.trainer.total_training_steps)
        name = config.remote_backend.name
        doing = (
            f"validating with backend '{name}' only (trainer.val_only=true)"
            if config.trainer.get("val_only", False)
            else f"training with backend '{name}' for {config.trainer.total_training_steps} steps"
        )
        print(f"verl-remote: {doing} (model {config.actor_rollout_ref.model.path})", flush=True)
        if not console.verbose:
            print(f"verl-remote: the full output goes to {console.log_path} (--verbose shows it here)", flush=True)
        summary = RunSummary()
        restarts = Restarts.from_config(config)
        began = time.time()
        attempt_config, resumed = config, resumed_config(config, began)[1]
        wait_s = 0.0
        while True:
            attempt = RunSummary()
            try:
                if wait_s:
                    wait_before_restart(wait_s)
                    console.restarting()
                # verl's trainer changes the config it is given (the trainer mode, the rollout's hand-off): each
                # attempt gets its own copy.
                run(copy.deepcopy(attempt_config), attempt, restarts=restarts.count)
            except KeyboardInterrupt:
                summary.extend(attempt)
                _report_end(console, config, summary)
                print("verl-remote train: interrupted", file=sys.stderr)
                return EXIT_INTERRUPTED
            except Terminated:
                summary.extend(attempt)
                _report_end(console, config, summary)
                print("verl-remote train: terminated by SIGTERM", file=sys.stderr)
                return EXIT_TERMINATED
            except (ConfigError, UnsupportedVerlError):  # found once the run starts (a cluster node that cannot see
                raise  # a path, a verl without the V1 trainer): exit 2, as before it
            except Exception as exc:
                if args.traceback:
                    raise
                console.log_only("".join(traceback.format_exception(exc)))
                summary.extend(attempt)
                step = attempt.first_step + len(attempt.rewards) if attempt.rewards else resumed + 1
                refusal = restarts.refusal(exc, step)
                if refusal is None:  # a transient fault: the run again, from its last checkpoint
                    attempt_config, resumed = resumed_config(config, began)
                    wait_s = restarts.wait_s()
                    summary.restarts = restarts.count
                    where = f"global_step_{resumed}" if resumed else "the start"
                    print(
                        f"verl-remote: restart {restarts.count} of {restarts.max} in {wait_s:g} s, from {where}: "
                        f"a transient fault at step {step}: {_failure(exc, console)}",
                        file=sys.stderr,
                        flush=True,
                    )
                    continue
                _report_end(console, config, summary)
                if refusal != "not transient":
                    print(f"verl-remote: not restarted: {refusal}", file=sys.stderr)
                print(f"verl-remote: the full output of this run is in {console.log_path}", file=sys.stderr)
                print(f"verl-remote train: the run failed: {_failure(exc, console)}", file=sys.stderr)
                return EXIT_FAILED
            summary.extend(attempt)
            break
    waits = summary.waits_line()
    if waits:
        print(waits, flush=True)
    if config.trainer.get("val_only", False) and not summary.rewards:
        print("verl-remote: validated only (trainer.val_only=true): no training step, as asked", flush=True)
    else:
        print(summary.line(), flush=True)
    return 0


def _report_end(console: Console, config: Any, summary: RunSummary) -> None:
    """Before the last line of a run that did not finish: its steps' rewards as far as it came, what was not shown,
    and where it can resume."""
    from verl_remote.runtime.checkpoints import complete_steps

    if not summary.rewards and console.rewards:  # Ray died under the run: its TaskRunner could not say
        summary = RunSummary([reward for _, reward in console.rewards], first_step=console.rewards[0][0])
    if summary.rewards:
        print(summary.line(), file=sys.stderr)

    if console.repeated_errors:
        print(
            f"verl-remote: {console.repeated_errors} more error lines like the ones above are in {console.log_path}",
            file=sys.stderr,
        )
    folder = str(config.trainer.default_local_dir)
    steps = complete_steps(folder)
    if steps:
        how = "the same command" if str(config.trainer.resume_mode) == "auto" else "trainer.resume_mode=auto"
        print(
            f"verl-remote: the last complete checkpoint is {folder}/global_step_{steps[0]}; {how} resumes from it",
            file=sys.stderr,
        )


def _failure(exc: BaseException, console: Console) -> str:
    """The run's failure in one line: what died when Ray itself lost a process (the error every caller then gets
    says only that a connection closed), else the innermost error."""
    if console.ray_died is not None:
        process, said = console.ray_died
        return f"Ray's {process} died under the run ({said!r}); its calls then failed ({type(exc).__name__})"
    if (problem := _media_problem(exc)) is not None:  # vLLM or transformers' models failing to import in a worker
        return f"{one_line(exc)}: {problem}"
    return one_line(exc)


def _media_problem(exc: BaseException) -> str | None:
    """The broken media packages (torchvision, say) with their fix, when ``exc`` comes from them; else None."""
    from verl_remote.cli.diagnostics import MEDIA_PACKAGES, media_packages_problem

    return media_packages_problem() if _involves(exc, MEDIA_PACKAGES) else None


def _cmd_export(args: argparse.Namespace) -> int:
    from verl_remote.runtime.export import plan_export, run_export

    try:
        run_export(plan_export(args.run_dir, args.step, args.out, adapter=args.adapter, overrides=args.overrides))
    except ValueError as exc:  # refused by the plan (a ConfigError) or by the backend, in its words
        if args.traceback:
            raise
        print(f"verl-remote export: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        if args.traceback:
            raise
        print(f"verl-remote export: the export failed: {one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from verl_remote.cli.doctor import Check, run_checks

    def show(check: Check) -> None:
        mark = "ok  " if check.ok else "FAIL"
        line = f"[{mark}] {check.name}"
        if check.detail:
            line += f": {check.detail}"
        print(line, flush=True)

    results = run_checks(ray_worker=not args.no_ray, on_check=show)
    failed = [c for c in results if not c.ok]
    print(f"doctor: {len(results) - len(failed)} checks passed, {len(failed)} failed")
    return EXIT_FAILED if failed else 0


def _losses(said: str | None) -> list[dict[str, str]] | str | None:
    """--losses: 'all', or policy losses and aggregations by name (gspo,token-sum,...)."""
    if said is None or said == "all":
        return said
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    from verl_remote.discovery.compose import ConfigError
    from verl_remote.testing.gradient import AGGREGATIONS, NEEDS

    losses: list[dict[str, str]] = []
    for name in said.split(","):
        if name not in AGGREGATIONS and name not in POLICY_LOSS_REGISTRY:
            raise ConfigError(
                f"--losses: verl has no policy loss or aggregation {name!r}; its policy losses: "
                f"{', '.join(sorted(POLICY_LOSS_REGISTRY))}; its aggregations: {', '.join(AGGREGATIONS)}"
            )
        if name in AGGREGATIONS:
            losses.append({"loss_agg_mode": name})
        else:
            losses.append({"policy_loss.loss_mode": name, **NEEDS.get(name, {})})
    return losses


def _cmd_check(args: argparse.Namespace) -> int:
    from verl_remote.discovery.registry import get_backend_spec
    from verl_remote.runtime.watchdog import start_watchdog
    from verl_remote.testing import check_backend

    get_backend_spec(args.name)  # an unknown name: exit 2 with the installed ones
    print(f"verl-remote check: backend '{args.name}' (a Ray instance of its own, the demo's tiny model)", flush=True)
    watchdog = start_watchdog()  # nothing of the checks outlives this process, however it ends
    try:
        results = check_backend(
            args.name,
            args.overrides,
            on_result=lambda r: print(r.line(), flush=True),
            on_progress=lambda line: print(f"       {line}", flush=True),
            losses=_losses(args.losses),
            precision=args.precision,
        )
    finally:
        os.close(watchdog)
    failed = [r for r in results if not r.ok and not r.skipped]
    skipped = [r for r in results if r.skipped]
    passed = len(results) - len(failed) - len(skipped)
    summary = f"check {args.name}: {passed} passed, {len(failed)} failed"
    if skipped:
        summary += f", {len(skipped)} not run"
    print(summary)
    return EXIT_FAILED if failed or skipped else 0


def _add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """What composes a run config, the same for every command that composes one."""
    parser.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra override, key=value")
    parser.add_argument(
        "--recipe",
        metavar="FILE",
        help="a recipe YAML (see configs/) to compose instead, or 'demo' for the built-in demo's settings (what a "
        "command that names no model and no data composes)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-remote",
        description="Run verl's RL post-training loop against a remote training and sampling backend.",
    )
    parser.add_argument("--version", action="version", version=f"verl-remote {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback on errors")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = commands.add_parser(
        "list",
        help="list installed backends",
        description="List every backend registered in the 'verl.remote_backends' entry-point group: "
        "name, distribution and version, config group, and whether its spec and classes import. "
        "Exits non-zero if any backend is broken.",
    )
    p.set_defaults(func=_cmd_list)

    p = commands.add_parser(
        "config",
        help="print the composed config",
        description="Compose verl's ppo_trainer config with the remote_backend group and print it as YAML. "
        "Takes the same overrides as 'verl-remote train' and 'python -m verl.trainer.main_ppo', "
        "e.g. remote_backend=<name> algorithm.adv_estimator=grpo remote_backend.<key>=<value>.",
    )
    _add_config_arguments(p)
    p.add_argument("--resolve", action="store_true", help="resolve interpolations before printing")
    p.add_argument(
        "--overrides",
        dest="as_overrides",
        action="store_true",
        help="print the settings that differ from verl's own ppo_trainer config as verl overrides, one per line "
        "(the demo's files made and named): python -m verl.trainer.main_ppo +remote_backend=<name> "
        "$(verl-remote config --overrides) runs the same",
    )
    p.set_defaults(func=_cmd_config)

    p = commands.add_parser(
        "train",
        help="train with verl on a backend (no model and no data given: the CPU demo)",
        description="Run verl's PPO/GRPO trainer with the selected backend (remote_backend=<name>, default local). "
        "Takes every verl override. Given no model and no data (actor_rollout_ref.model.path, data.train_files, "
        "data.val_files) it runs the demo: a tiny model, tokenizer and data set made locally on first use, GRPO, "
        "about 3 minutes on a laptop CPU. A run of your own model or data gets verl's own defaults for what it does "
        "not set, never the demo's (docs/user-guide.md). Ctrl-C stops the run and destroys the backend. "
        "The console shows verl-remote's lines, a row per step (reward, length, loss, time left) and errors; every "
        "metric and the full output of every process go to <trainer.default_local_dir>/logs/.",
    )
    _add_config_arguments(p)
    p.add_argument(
        "--verbose",
        action="store_true",
        help="print the output of every process of the run on the console (also: VERL_REMOTE_VERBOSE=1)",
    )
    p.set_defaults(func=_cmd_train)

    p = commands.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model folder",
        description="Write the weights of one complete checkpoint of a run as a Hugging Face model folder "
        "(config.json, the tokenizer, *.safetensors) that transformers and vLLM load. Reads the run folder's "
        "record of its backend and config; the backend reads the checkpoint, from the service where it is kept. "
        "A LoRA is merged into its base model unless --adapter. The folder appears once complete.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run's folder (its trainer.default_local_dir)")
    p.add_argument(
        "--step", default="latest", help="the checkpoint's step, or 'latest' (the default): the newest complete one"
    )
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write: a new or an empty one")
    p.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write the adapter alone (a PEFT folder) instead of merging it into the base model",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="remote_backend.KEY=VALUE",
        help="settings of the backend to use instead of the run's recorded ones, e.g. the service's new address "
        "(remote_backend.base_url=..., remote_backend.comms.url=...)",
    )
    p.set_defaults(func=_cmd_export)

    p = commands.add_parser(
        "doctor",
        help="check that verl, the plugins and every backend work here",
        description="Check the verl version, that verl loads verl-remote's plugin, that Hydra finds the search "
        "path plugin, and that every installed backend loads and its config group composes, in this process "
        "and in a Ray worker process of a local Ray cluster. Exits non-zero on any failure.",
    )
    p.add_argument("--no-ray", action="store_true", help="skip the checks in a Ray worker process")
    p.set_defaults(func=_cmd_doctor)

    p = commands.add_parser(
        "check",
        help="run the conformance checks against an installed backend",
        description="Drive backend NAME as a training run does, without verl's trainer: its spec and group "
        "file, from_config and the reconnect handle, a forwarder and a rollout server re-attached in their own "
        "Ray processes, the log-prob layout, the sampler, a training step, weight sync, a checkpoint round "
        "trip, the loss's gradient against verl's, overlap and destroy. One line per check, with a fix for each "
        "failure. Exits 0 when every check passes, 1 otherwise.",
    )
    p.add_argument("name", help="the backend's name (see 'verl-remote list')")
    p.add_argument("overrides", nargs="*", metavar="OVERRIDE", help="Hydra override for the backend, key=value")
    p.add_argument(
        "--losses",
        metavar="LIST",
        help="the losses the gradient check compares with verl's: 'all' (every policy loss verl has, every "
        "aggregation, the KL loss) or names, comma-separated (gspo,cispo,seq-mean-token-mean); by default every "
        "policy loss mode the backend claims (each its preflight accepts), with the configured aggregation and KL "
        "term",
    )
    p.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="what the service computes in; bf16 allows the log-probs and the gradient check bf16's rounding "
        "(verl_remote.testing.checks.PRECISIONS; default fp32)",
    )
    p.set_defaults(func=_cmd_check)
    return parser


def _involves(exc: BaseException, packages: Sequence[str]) -> bool:
    """Whether ``exc`` or an exception it comes from was raised in, or names, one of ``packages``: an error of
    another kind is not blamed on a broken install that happens to be there."""
    import traceback

    seen: BaseException | None = exc
    while seen is not None:
        frames = traceback.extract_tb(seen.__traceback__)
        if any(f"/{name}/" in frame.filename for frame in frames for name in packages):
            return True
        if any(name in str(seen) for name in packages):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def main(argv: Sequence[str] | None = None) -> int:
    from verl_remote.discovery.compat import UnsupportedVerlError
    from verl_remote.discovery.compose import ConfigError

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        # argparse ends a positional list at the first option: `train a=1 --verbose b=2` leaves b=2 over.
        if not hasattr(args, "overrides") or any(word.startswith("-") for word in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    try:
        code: int = args.func(args)
    except (BackendError, UnsupportedVerlError) as exc:
        if args.traceback:
            raise
        print(f"verl-remote {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ConfigError as exc:
        if args.traceback:
            raise
        print(f"verl-remote {args.command}: invalid config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        # An environment whose torchvision (say) cannot load fails in whatever imports transformers' models first,
        # with a traceback that does not say why: say it, with the fix.
        if args.traceback or (problem := _media_problem(exc)) is None:
            raise
        print(f"verl-remote {args.command}: error: {one_line(exc)}: {problem}", file=sys.stderr)
        return EXIT_FAILED
    return code


def console_main() -> None:
    """The ``verl-remote`` console script: :func:`main`, then its exit code.

    Input refused before Ray started leaves nothing to clean up, so the process ends as soon as its message is
    out, without the interpreter's teardown of the modules a refusal imports (verl, torch; about a second on
    2 cores: benchmarks/refusal.py). Everything else exits the ordinary way, with Ray's and Python's exit hooks.
    """
    code = main()
    ray = sys.modules.get("ray")
    if code == EXIT_USAGE and (ray is None or not ray.is_initialized()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    console_main()
