"""verl-remote on a Ray cluster it did not start: `ray job submit`, several nodes, paths a node cannot see.

The cluster is Ray's own, started with `ray start` as an operator would: a head node with no CPUs (so nothing
of a run lands on the driver's node) and worker nodes on loopback, each with its own raylet, with Ray's
token authentication on. A node can be given an empty folder over a path (its own mount namespace with a
tmpfs there), which is what a machine without the shared storage sees.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import QUICK, cli, faulty_calls, free_port, left_behind, processes_in, run, script, step_row, steps

pytestmark = [pytest.mark.train, pytest.mark.cluster]

RAY = script("ray")


class LocalCluster:
    """A Ray cluster of `ray start` nodes on 127.0.0.1, every process working in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.dashboard_port = free_port()
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": uuid.uuid4().hex,
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dashboard_port}"
        self._ray(
            "start", "--head", f"--port={self.port}", f"--dashboard-port={self.dashboard_port}",
            f"--ray-client-server-port={free_port()}", "--num-cpus=0",
        )  # fmt: skip

    def _ray(self, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
        command = [*prefix, RAY, *args, "--node-ip-address=127.0.0.1", f"--dashboard-agent-listen-port={free_port()}"]
        out = run(*command, env=self.env, cwd=self.folder, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out

    def add_node(self, num_cpus: int, hide: tuple[Path, ...] = ()) -> None:
        """A worker node; each folder in ``hide`` is an empty one on that node only."""
        prefix: tuple[str, ...] = ()
        if hide:
            mounts = " && ".join(f"mount -t tmpfs tmpfs '{folder}'" for folder in hide)
            prefix = ("unshare", "--mount", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$0" "$@"')
        self._ray("start", f"--address={self.address}", f"--num-cpus={num_cpus}", prefix=prefix)

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """A Ray CLI command against this cluster (ray job ..., ray list ...)."""
        env = {**self.env, "RAY_API_SERVER_ADDRESS": self.dashboard, "RAY_ADDRESS": self.address}
        return run(RAY, *args, env=env, cwd=self.folder, timeout=timeout)

    def listed(self, kind: str) -> list[dict[str, str]]:
        out = self.cli("list", kind, "--format=json", "--limit=1000")
        assert out.returncode == 0, out.stderr[-2000:]
        if out.stdout.startswith("No resource in the cluster"):  # what Ray prints for an empty list
            return []
        return list(json.loads(out.stdout))

    def alive_actors(self) -> list[str]:
        return [a["class_name"] for a in self.listed("actors") if a["state"] == "ALIVE"]

    def placement_groups_left(self) -> list[str]:
        return [g["name"] for g in self.listed("placement-groups") if g["state"] != "REMOVED"]

    def head_node_id(self) -> str:
        nodes = self.listed("nodes")
        return next(n["node_id"] for n in nodes if n["is_head_node"])

    def stop(self) -> None:
        """End every process of this cluster (those working in its folder), and nothing else on the machine."""
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid in processes_in(self.folder):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait_s
            while processes_in(self.folder) and time.monotonic() < deadline:
                time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A head node with no CPUs and two worker nodes (4 and 5 CPUs), for the module."""
    if shutil.which("unshare") is None:
        pytest.fail("the cluster tests need util-linux's unshare (a node with its own mounts)")
    folder = tmp_path_factory.mktemp("cluster")
    started = LocalCluster(folder)
    try:
        started.add_node(num_cpus=4)
        started.add_node(num_cpus=5)
        yield started
    finally:
        started.stop()
    assert processes_in(folder) == {}


def _steps(text: str) -> list[int]:
    """The steps the run printed, in order. Nodes on one machine share Ray's session folder, so each node's log
    monitor forwards every worker's lines: a line can arrive once per node."""
    return list(dict.fromkeys(steps(text)))


#: Ray started in a new interpreter as ``verl-remote train``'s driver starts it (``ray.init()`` alone with ``bare``);
#: then the address of the cluster it is in.
_RAY_OF_A_RUN = """
import sys
import ray
from verl_remote.cli.run import _ray_init
from verl_remote.discovery.compose import compose_config

if sys.argv[1] == "bare":
    ray.init()
else:
    _ray_init(compose_config([], recipe="demo"))
print("in the cluster at", ray.get_runtime_context().gcs_address)
ray.shutdown()
"""


@pytest.mark.faults
def test_a_run_joins_a_ray_start_cluster_on_its_machine_only_when_ray_address_asks_for_it(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The module's cluster is one someone started on this machine with `ray start`, which leaves its address for
    Ray to find: a bare ``ray.init()`` joins it. A run's own start of Ray does not, unless RAY_ADDRESS names it."""

    def gcs_port(how: str, env: dict[str, str]) -> int:
        """The port of the GCS of the cluster ``how`` is in (a driver names it by the machine's own address)."""
        out = run(sys.executable, "-c", _RAY_OF_A_RUN, how, env=env, cwd=tmp_path, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return int(out.stdout.strip().splitlines()[-1].rsplit(":", 1)[1])

    assert "RAY_ADDRESS" not in cluster.env
    assert gcs_port("bare", cluster.env) == cluster.port  # what the run is kept from
    assert gcs_port("run", cluster.env) != cluster.port  # an instance of its own
    assert gcs_port("run", {**cluster.env, "RAY_ADDRESS": cluster.address}) == cluster.port
    assert left_behind(tmp_path) == {}  # the run's own instance ended with it


@pytest.mark.faults
def test_ray_job_submit_trains_off_the_driver_node_stops_and_leaves_the_cluster_as_it_found_it(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    calls = tmp_path / "calls.txt"
    backend = ["remote_backend=faulty", f"remote_backend.calls_log={calls}"]

    # `ray job submit`: the run trains on the worker nodes. `ray job stop` once step 2 is saved (the steps after a
    # save are slow, so the stop lands in step 3): SIGTERM to the entrypoint, which destroys the backend within
    # Ray's grace period.
    submitted = cluster.cli(
        "job", "submit", "--no-wait", "--submission-id=stopped", "--", script(), "train", *backend, *QUICK,
        "trainer.save_freq=2", "remote_backend.hold_after_save_s=30", "trainer.total_training_steps=40",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    deadline = time.monotonic() + 600
    while step_row(2) not in cluster.cli("job", "logs", "stopped").stdout:
        assert time.monotonic() < deadline, cluster.cli("job", "logs", "stopped").stdout[-3000:]
        time.sleep(2)
    stopped = cluster.cli("job", "stop", "stopped")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    logs = cluster.cli("job", "logs", "stopped").stdout
    assert _steps(logs) == [1, 2]
    assert "joining a running Ray cluster" in logs
    assert "verl-remote: the 2 nodes with CPUs see the run's data, model and folder" in logs
    assert "verl-remote: terminated (SIGTERM); destroying the backend" in logs
    # Step 3 holds in its weight sync (hold_after_save_s) when the stop lands (on a busy machine, a later sync):
    # the backend is destroyed once, at the end; nothing is saved after step 2.
    made = faulty_calls(calls)
    assert made[:4] == ["update_weights", "update_weights", "save_checkpoint 2", "update_weights"], made
    assert made[-1] == "destroy" and made.count("destroy") == 1, made
    assert [call for call in made if call.startswith("save_checkpoint")] == ["save_checkpoint 2"], made
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("global_step_*")) == ["global_step_2"]

    head = cluster.head_node_id()
    placed = {(a["class_name"], a["node_id"]) for a in cluster.listed("actors") if a["class_name"] != "JobSupervisor"}
    classes = {name for name, _ in placed}
    # FaultyServer: the rollout server. The TaskRunner runs in the entrypoint's process (on the head), no actor.
    assert {"LocalEngineActor", "FaultyServer"} <= classes and "RemoteTaskRunner" not in classes, classes
    assert any("WorkerDict" in name for name in classes), classes  # verl's forwarder workers
    # What reserves CPUs (verl's forwarders, the engine) runs on the worker nodes; a rollout server
    # reserves none, so Ray may put it on the head too.
    holding = [(name, node) for name, node in placed if name != "FaultyServer"]
    assert all(node != head for _, node in holding), placed
    assert len({node for _, node in placed}) >= 2, placed  # the run spans nodes
    assert cluster.alive_actors() == []
    assert cluster.placement_groups_left() == []

    # verl's own launcher as the entrypoint, given the printed overrides (less the CPU count a cluster has already),
    # resumes the stopped job's run through verl-remote's checkpoint records: the next step, from the saved state.
    # (A driver of the user's own with RAY_ADDRESS set runs as the job's entrypoint did: Ray sets RAY_ADDRESS.)
    calls.unlink()
    words = cli("config", "--overrides", *backend)
    assert words.returncode == 0, words.stderr[-3000:]
    assert f"remote_backend.calls_log={calls}" in words.stdout.split()  # differs from the group file's value
    verl = cluster.cli(
        "job", "submit", "--", sys.executable, "-m", "verl.trainer.main_ppo", "+remote_backend=faulty",
        *words.stdout.split(), *QUICK, "ray_kwargs.ray_init.num_cpus=null", "trainer.total_training_steps=3",
        f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        timeout=600,
    )  # fmt: skip
    assert verl.returncode == 0, verl.stdout[-3000:] + verl.stderr[-3000:]
    assert "succeeded" in verl.stdout + verl.stderr
    # verl's launcher does not restart after a transient fault, and says so (verl-remote train does).
    assert (
        "verl-remote: under verl's own launcher a transient fault (a lost connection, an HTTP 502) stops the run"
        in (verl.stdout + verl.stderr)
    )
    assert _steps(verl.stdout) == [3]
    assert re.search(r"verl-remote: 1 steps \(3-3\); mean reward \d\.\d{3} over the first 1", verl.stdout)
    assert faulty_calls(calls)[0] == "load_checkpoint 2"
    assert faulty_calls(calls).count("destroy") == 1
    assert cluster.alive_actors() == []
    assert cluster.placement_groups_left() == []


@pytest.mark.faults
def test_a_node_that_cannot_see_the_runs_files_is_named_before_anything_starts(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The demo's files (made on the driver) and the checkpoint folder, hidden from one node.

    The node joins the module's cluster for good: this test comes last."""
    words = cli("config", "--overrides")
    assert words.returncode == 0, words.stderr[-3000:]
    demo = Path(next(w for w in words.stdout.split() if w.startswith("data.train_files=")).split("=", 1)[1])
    demo_root = demo.parent.parent  # .../verl-remote/demo-vN
    shared = tmp_path / "shared"
    shared.mkdir()
    cluster.add_node(num_cpus=1, hide=(demo_root, shared))
    env = {**cluster.env, "RAY_ADDRESS": cluster.address}
    calls = tmp_path / "calls.txt"
    args = ["train", "remote_backend=faulty", f"remote_backend.calls_log={calls}", *QUICK]

    out = run(script(), *args, f"trainer.default_local_dir={shared / 'ckpt'}", env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"data.train_files={demo} cannot be seen from node" in out.stderr
    assert "set XDG_CACHE_HOME to a folder every node sees" in out.stderr
    assert faulty_calls(calls) == []  # the backend was never made

    data = tmp_path / "data"
    shutil.copytree(demo.parent, data)
    moved = [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}"]
    model = tmp_path / "model"
    shutil.copytree(demo_root / "model", model)
    moved.append(f"actor_rollout_ref.model.path={model}")
    # Copies of the demo's files are files of the user's: the demo's settings are asked for by name.
    demo_recipe = ["train", "--recipe", "demo", *args[1:]]
    out = run(script(), *demo_recipe, *moved, f"trainer.default_local_dir={shared / 'ckpt'}", env=env, cwd=tmp_path)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"trainer.default_local_dir={shared / 'ckpt'} cannot be seen from node" in out.stderr
    assert "lock file .verl-remote.lock is not there" in out.stderr
    assert faulty_calls(calls) == []
    assert cluster.alive_actors() == []
    assert not list((shared / "ckpt").glob("global_step_*"))
