"""What verl-remote costs the machine it runs on, per sample: every process's CPU-seconds a step, split into the
client (verl and verl-remote: the driver, Ray's own processes, verl's workers) and the service.

    python benchmarks/client_cost.py [--sizes 64 512 4096] [--backends instant local] [--steps 10]
                                     [--verl-sizes 64 512] [--sdk] [--sdk-sizes 64 512] [--detail]

Each run is the demo (its model, data and reward) with ``data.train_batch_size`` set for the size (8 samples a
prompt, one optimizer step a training step), no validation and no checkpoints, on:

- ``instant``: a benchmark-only backend whose service answers every call at once (benchmarks/instant-backend), so
  that what a step costs is the client's alone;
- ``local``: the embedded local backend; its engine (``LocalEngineActor``: sampling and training the model) is
  the service.

The baseline: the ``instant`` backend at each of ``--verl-sizes`` with verl's own agent-loop manager
(``actor_rollout_ref.rollout.agent.agent_loop_manager_class`` set to verl's ``AgentLoopManagerTQ``: an agent-loop
worker and a reward worker serving each sample), as every run was before verl-remote's own.

Every process is read at each step's row; a step's CPU is the mean over the steps after the second. ``--sdk``
also runs, on SkyRL's Tinker server (its environment built once), the plain tinker-SDK GRPO loop of
benchmarks/sdk_loop.py and ``verl-remote train`` with the Tinker backend at each of ``--sdk-sizes``: the SDK
loop's own process's CPU a sample beside verl-remote's client's, and the server's CPU beside both.

The figures of record are in docs/measurements.md ("The client's cost").
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from processes import VERL_REMOTE, Watched, tree, watch

ROOT = Path(__file__).resolve().parents[1]
TINKER_RECIPE = ROOT / "configs" / "tinker-local-server.yaml"
STEP_ROW = re.compile(r"^step (\d+)/\d+\s.*reward ")
#: Samples a prompt (the demo's rollout.n).
N = 8
#: The processes that are the service, by backend (everything else of a run is the client).
SERVICE = {"local": ("ray::LocalEngineActor",), "instant": (), "tinker": ()}
#: The override that runs verl's own agent-loop manager (the baseline).
VERL_AGENT_LOOP = (
    "actor_rollout_ref.rollout.agent.agent_loop_manager_class=verl.trainer.ppo.v1.agent_loop_tq.AgentLoopManagerTQ"
)
#: verl's agent-loop worker, shown on its own.
AGENT_LOOP = ("ray::AgentLoopWorkerTQ", "ray::AgentLoopWorker")


@dataclass
class Cost:
    """CPU-seconds a step, by process name, and a step's wall time."""

    by_process: dict[str, float]
    service_names: tuple[str, ...]
    step_s: float
    samples: int
    external_service_cpu: float = 0.0  # a service outside the run's processes (the Tinker server)

    @property
    def client(self) -> float:
        return sum(v for k, v in self.by_process.items() if k not in self.service_names)

    @property
    def service(self) -> float:
        return self.external_service_cpu + sum(v for k, v in self.by_process.items() if k in self.service_names)

    def ms(self, seconds: float) -> float:
        return 1000 * seconds / self.samples


def overrides_for(samples: int, steps: int, folder: str) -> list[str]:
    prompts = samples // N
    return [
        f"data.train_batch_size={prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=false",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        f"trainer.default_local_dir={folder}/ckpt",
    ]


def per_step(run: Watched, service: tuple[str, ...], samples: int) -> Cost:
    """CPU-seconds a step by process, between the second step's row and the last's."""
    rows = [(index, cpu) for index, cpu in run.marks if STEP_ROW.search(run.lines[index][1])]
    if len(rows) < 3:
        raise SystemExit(f"the run printed {len(rows)} step rows; it needs 3 or more (--steps)")
    (first, before), (last, after) = rows[1], rows[-1]
    steps = len(rows) - 2
    by_process: dict[str, float] = {}
    external = 0.0
    for pid, cpu in after.items():
        spent = (cpu - before.get(pid, 0.0)) / steps
        if pid in run.external:
            external += spent
            continue
        name = "verl-remote train (the driver)" if pid == run.root else run.processes[pid].name.split(".")[0]
        if name.startswith("ray ("):
            name = "Ray's own processes"
        by_process[name] = by_process.get(name, 0.0) + spent
    wall = (run.lines[last][0] - run.lines[first][0]) / steps
    return Cost(by_process, service, wall, samples, external)


def run_verl_remote(backend: str, samples: int, steps: int, also: list[str], service_pid: int | None = None) -> Cost:
    with tempfile.TemporaryDirectory(prefix="verl-remote-client-cost-") as folder:
        chosen = ["--recipe", str(TINKER_RECIPE)] if backend == "tinker" else [f"remote_backend={backend}"]
        command = [VERL_REMOTE, "train", *chosen, *overrides_for(samples, steps, folder), *also]
        run = watch(command, cwd=folder, mark=STEP_ROW, extra_pids=[] if service_pid is None else [service_pid])
    if run.code != 0:
        tail = "\n".join(line for _, line in run.lines[-20:])
        raise SystemExit(f"verl-remote train exited {run.code}:\n{tail}")
    return per_step(run, SERVICE[backend], samples)


def table(rows: list[tuple[str, Cost]]) -> None:
    print(
        "| run | samples a step | client ms/sample | of which verl's agent-loop worker | service ms/sample | step s |"
    )
    print("|---|---|---|---|---|---|")
    for name, cost in rows:
        loop = sum(v for k, v in cost.by_process.items() if k in AGENT_LOOP)
        service = f"{cost.ms(cost.service):.1f}" if cost.service or cost.service_names else "-"
        print(
            f"| {name} | {cost.samples} | {cost.ms(cost.client):.1f} | {cost.ms(loop):.1f} | {service} | "
            f"{cost.step_s:.2f} |"
        )


def detail(name: str, cost: Cost) -> None:
    print(f"\n{name}, {cost.samples} samples a step: CPU ms a sample, by process")
    for process, seconds in sorted(cost.by_process.items(), key=lambda item: -item[1]):
        print(f"  {cost.ms(seconds):7.2f}  {process}")


def sdk_cost(url: str, server_pid: int, samples: int, steps: int) -> Cost:
    """The plain SDK loop of benchmarks/sdk_loop.py at ``samples`` a step: its own process's CPU and the server's,
    a step, after the second step."""
    from sdk_loop import sdk_loop

    marks: list[tuple[float, float, float]] = []  # wall, this process's CPU, the server's CPU

    def mark() -> None:
        served = 0.0
        for proc in tree(server_pid):
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            served += times.user + times.system
        marks.append((time.monotonic(), time.process_time(), served))

    asyncio.run(sdk_loop(url, steps, batch=samples // N, on_step=mark))
    (wall0, own0, served0), (wall1, own1, served1) = marks[1], marks[-1]
    count = len(marks) - 2
    return Cost({"the SDK loop's process": (own1 - own0) / count}, (), (wall1 - wall0) / count, samples,
                (served1 - served0) / count)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 512, 4096], help="samples a step")
    parser.add_argument("--backends", nargs="+", default=["instant", "local"], choices=["instant", "local"])
    parser.add_argument("--steps", type=int, default=10, help="steps of each run (the first two are not counted)")
    parser.add_argument("--verl-sizes", type=int, nargs="*", default=[64, 512], help="the baseline's samples a step")
    parser.add_argument("--sdk", action="store_true", help="also the SDK loop and the Tinker backend on SkyRL's")
    parser.add_argument("--sdk-sizes", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--detail", action="store_true", help="each run's CPU by process")
    parser.add_argument("overrides", nargs="*", help="overrides for every verl-remote run (after --)")
    args = parser.parse_args()
    if any(size % N for size in args.sizes + args.verl_sizes + args.sdk_sizes):
        parser.error(f"sizes are samples a step: multiples of {N}")

    rows: list[tuple[str, Cost]] = []
    for backend in args.backends:
        for size in args.sizes:
            cost = run_verl_remote(backend, size, args.steps, args.overrides)
            print(f"{backend}, {size} samples: client {cost.ms(cost.client):.1f} ms/sample", file=sys.stderr)
            rows.append((f"verl-remote, {backend} backend", cost))
    for size in args.verl_sizes:
        cost = run_verl_remote("instant", size, args.steps, [VERL_AGENT_LOOP, *args.overrides])
        print(
            f"instant, verl's agent loop, {size} samples: client {cost.ms(cost.client):.1f} ms/sample", file=sys.stderr
        )
        rows.append(("verl-remote, instant backend, verl's agent loop (the baseline)", cost))
    if args.sdk:
        from verl_remote_tinker.testing.local_server import start_local_server

        with (
            tempfile.TemporaryDirectory(prefix="client-cost-") as tmp,
            start_local_server(workdir=Path(tmp) / "tinker-server") as server,
        ):
            pid = server.pid
            for size in args.sdk_sizes:
                rows.append(("tinker SDK loop, SkyRL's Tinker server", sdk_cost(server.url, pid, size, args.steps)))
                also = [f"remote_backend.base_url={server.url}", *args.overrides]
                cost = run_verl_remote("tinker", size, args.steps, also, pid)
                rows.append(("verl-remote, Tinker backend, SkyRL's Tinker server", cost))
    print(f"\nCPU a sample, a step's mean after the second ({psutil.cpu_count()} CPUs)\n")
    table(rows)
    if args.detail:
        for name, cost in rows:
            detail(name, cost)
    return 0


if __name__ == "__main__":
    sys.exit(main())
