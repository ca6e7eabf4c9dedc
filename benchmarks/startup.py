"""From ``verl-remote train`` to its first step, and its steps: wall time by phase, CPU-seconds by process.

    python benchmarks/startup.py [--steps 5] [--runs 3] [-- OVERRIDE ...]

Runs the demo as a user does (``verl-remote train``, with no override but the number of steps and any given after
``--``), each run in a fresh temporary folder, and watches it from outside: the time of each console line, and
every process of the run (the CLI's own, Ray's, each Ray worker under the name of the actor it became), sampled
every 0.2 s with its CPU time. Prints, as the median of the runs:

- the phases: the CLI's first line, Ray's node up (its raylet), each of verl's actors started (in order), the
  sampler's line, the validation before step 1, step 1's row, the last step's row, the command's end; where the
  run waited for its service (a service being provisioned), when it answered and step 1 counted from then;
- the CPU-seconds of each process (what it had used when last seen), the CLI's own first;
- a step: the median time between step rows after the first.

Measure on a quiet machine with the demo's files made (a first ``verl-remote train`` makes them). The figures
of record and what each change did are in docs/measurements.md.
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import sys
import tempfile

from processes import VERL_REMOTE, Watched, watch

#: Console lines that mark a phase, by the phase's name.
PHASES = {
    "first line": re.compile(r"^verl-remote: training with backend "),
    # Only where the run waited for its service (a service provisioned or loading): step 1 counts from here.
    "the service answered": re.compile(r"^verl-remote: the service answered after "),
    "sampler line": re.compile(r"^verl-remote: the \w+ backend samples with "),
    "validation (step 0)": re.compile(r"^step 0/"),
    "step 1": re.compile(r"^step 1/"),
}
STEP_ROW = re.compile(r"^step (\d+)/(\d+)\s.*reward ")

Run = Watched


def run_once(steps: int, overrides: list[str]) -> Run:
    with tempfile.TemporaryDirectory(prefix="verl-remote-startup-") as folder:
        run = watch([VERL_REMOTE, "train", f"trainer.total_training_steps={steps}", *overrides], cwd=folder)
    if run.code != 0:
        tail = "\n".join(line for _, line in run.lines[-20:])
        sys.exit(f"verl-remote train exited {run.code}:\n{tail}")
    return run


def phases(run: Run) -> dict[str, float]:
    found: dict[str, float] = {}
    for name, pattern in PHASES.items():
        at = next((t for t, line in run.lines if pattern.search(line)), None)
        if at is not None:
            found[name] = at
    if run.raylet_at is not None:
        found["Ray's node up"] = run.raylet_at
    started: dict[str, float] = {}  # each actor class's first process
    for first, name in sorted((seen.first, seen.name) for seen in run.processes.values()):
        if name.startswith("ray::"):
            started.setdefault(name.split(".")[0], first)
    for name, first in started.items():
        found[f"{name} started"] = first
    rows = [t for t, line in run.lines if STEP_ROW.search(line)]
    if rows:
        found["last step"] = rows[-1]
    found["end"] = run.end
    return found


def step_time(run: Run) -> float | None:
    rows = [t for t, line in run.lines if STEP_ROW.search(line)]
    gaps = [b - a for a, b in itertools.pairwise(rows[1:])]  # after step 1 (its row has the first sample)
    return statistics.median(gaps) if gaps else None


def cpu_by_process(run: Run) -> dict[str, float]:
    totals: dict[str, float] = {}
    for pid, seen in run.processes.items():
        name = "verl-remote train (the driver)" if pid == run.root else seen.name.split(".")[0]
        if name.startswith("ray ("):
            name = "Ray's own processes"
        elif not name.startswith(("ray::", "verl-remote")):
            name = "other processes"
        totals[name] = totals.get(name, 0.0) + seen.cpu
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps of each run (default 5)")
    parser.add_argument("--runs", type=int, default=3, help="runs; each figure is their median (default 3)")
    parser.add_argument("overrides", nargs="*", help="overrides for every run (after --)")
    args = parser.parse_args()

    runs = []
    for i in range(args.runs):
        runs.append(run_once(args.steps, args.overrides))
        print(f"run {i + 1}/{args.runs}: {runs[-1].end:.1f} s", file=sys.stderr, flush=True)

    print(f"verl-remote train, {args.steps} steps, median of {args.runs} runs\n")
    print("| phase | seconds after the command started |\n|---|---|")
    table = [phases(run) for run in runs]
    names = sorted(
        {name for found in table for name in found},
        key=lambda n: statistics.median([found[n] for found in table if n in found]),
    )
    for name in names:
        values = [found[name] for found in table if name in found]
        print(f"| {name} | {statistics.median(values):.1f} |")
    answered = [found["step 1"] - found["the service answered"] for found in table if "the service answered" in found]
    if answered:
        print(f"| step 1, after the service answered | {statistics.median(answered):.1f} |")
    steps = [s for s in (step_time(run) for run in runs) if s is not None]
    if steps:
        print(f"| a step (between rows, after step 1) | {statistics.median(steps):.2f} |")

    print("\n| process | CPU-seconds |\n|---|---|")
    cpu = [cpu_by_process(run) for run in runs]
    everyone = sorted(
        {name for found in cpu for name in found},
        key=lambda n: -statistics.median([found.get(n, 0.0) for found in cpu]),
    )
    for name in everyone:
        print(f"| {name} | {statistics.median([found.get(name, 0.0) for found in cpu]):.1f} |")
    print(f"| in all | {statistics.median([sum(found.values()) for found in cpu]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
