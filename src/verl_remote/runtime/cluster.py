"""What every node of a Ray cluster must see before a run starts there.

verl opens the run's files in whichever process needs them: the TaskRunner reads
the data, the tokenizer and the model's config; reward workers import the
reward function; the TaskRunner and the forwarders write under the checkpoint
folder. On one machine they all see the driver's files. On a cluster each of
those processes may land on any node, so each path has to be on storage every
node sees, at the same path. :func:`check_cluster_paths` asks every node that
can run workers, before anything else starts there, and names the first path a
node cannot see, with the node.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, ListConfig

from verl_remote.discovery.compose import ConfigError
from verl_remote.kit.errors import root_cause

__all__ = ["SharedPath", "check_cluster_paths", "shared_paths"]

#: How long a node has to start a worker and answer.
ANSWER_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SharedPath:
    """A path the run's workers open, named by the config key that sets it."""

    key: str
    path: str
    #: "file", "dir", or "run-folder" (this run's lock file must be there: the same folder, not a namesake).
    kind: str


def _local(value: Any) -> str | None:
    """An absolute path on a file system, or None for a remote URI (hdfs://, s3://, ...) or a hub name."""
    text = str(value)
    return text if text.startswith("/") else None


def shared_paths(config: DictConfig, lock_file: str | None = None) -> list[SharedPath]:
    """The paths of the composed run config that verl's processes open, wherever they run."""
    found: list[SharedPath] = []
    for key in ("data.train_files", "data.val_files"):
        value = config.get("data", {}).get(key.split(".")[1])
        for item in value if isinstance(value, ListConfig | list) else [value]:
            if item is not None and (path := _local(item)):
                found.append(SharedPath(key, path, "file"))
    model = config.actor_rollout_ref.model
    for key, value in (
        ("actor_rollout_ref.model.path", model.get("path")),
        ("actor_rollout_ref.model.tokenizer_path", model.get("tokenizer_path")),
    ):
        if value and (path := _local(value)):
            found.append(SharedPath(key, path, "dir" if os.path.isdir(path) else "file"))
    reward_fn = config.get("reward", {}).get("custom_reward_function", {}).get("path")
    if reward_fn and (path := _local(reward_fn)):
        found.append(SharedPath("reward.custom_reward_function.path", path, "file"))
    folder = str(config.trainer.default_local_dir)
    if lock_file:
        found.append(SharedPath("trainer.default_local_dir", os.path.join(folder, lock_file), "run-folder"))
    else:
        found.append(SharedPath("trainer.default_local_dir", folder, "dir"))
    return found


def _missing(paths: list[SharedPath]) -> list[SharedPath]:
    """Run on one node: the paths this node cannot see (a folder that is not there yet counts as seen when its
    parent is, since the run creates it)."""
    missing = []
    for item in paths:
        if item.kind == "file":
            ok = os.path.isfile(item.path)
        elif item.kind == "dir":
            ok = os.path.isdir(item.path) or (item.key == "trainer.default_local_dir" and _creatable(item.path))
        else:
            ok = os.path.exists(item.path)
        if not ok:
            missing.append(item)
    return missing


def _creatable(folder: str) -> bool:
    parent = os.path.dirname(os.path.abspath(folder))
    while parent and not os.path.isdir(parent):
        parent = os.path.dirname(parent)
    return bool(parent) and os.access(parent, os.W_OK)


def check_cluster_paths(config: DictConfig, lock_file: str | None = None) -> int:
    """Ask every alive node with CPUs whether it sees the run's paths; raise ConfigError naming the first it does
    not. Returns the number of nodes asked (0 when every worker runs on this node, as on one machine)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = ray.get_runtime_context().get_node_id()
    nodes = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0]
    others = [n for n in nodes if n["NodeID"] != here]
    if not others:
        return 0
    paths = shared_paths(config, lock_file)
    probe = ray.remote(num_cpus=0, max_retries=0)(_missing)
    pending = {
        probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)).remote(
            paths
        ): node
        for node in nodes
    }
    for ref, node in pending.items():
        where = f"node {node.get('NodeManagerAddress', '?')} (node id {node['NodeID'][:12]})"
        try:
            missing = ray.get(ref, timeout=ANSWER_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise ConfigError(
                f"{where} did not start a worker within {ANSWER_TIMEOUT_S:.0f} s; check it with 'ray status' "
                "and its raylet log"
            ) from None
        except ray.exceptions.RayTaskError as exc:
            cause = root_cause(exc)
            if isinstance(cause, ModuleNotFoundError | ImportError):
                raise ConfigError(
                    f"{where} cannot import verl-remote ({cause}): install verl-remote and the backend's "
                    "distribution on every node, in the same Python environment as the driver's"
                ) from None
            raise
        if missing:
            item = missing[0]
            what = {
                "file": "the file is not there",
                "dir": "the folder is not there",
                "run-folder": f"this run's lock file {os.path.basename(item.path)} is not there, so the node "
                "sees another folder of that name or none",
            }[item.kind]
            path = os.path.dirname(item.path) if item.kind == "run-folder" else item.path
            hint = ""
            if "/verl-remote/demo" in path:
                hint = (
                    "; the demo's files are made on the driver under $XDG_CACHE_HOME/verl-remote "
                    "(default ~/.cache): set XDG_CACHE_HOME to a folder every node sees"
                )
            others_missing = f" (and {len(missing) - 1} more path(s))" if len(missing) > 1 else ""
            raise ConfigError(
                f"{item.key}={path} cannot be seen from {where}: {what}{others_missing}. Every node that runs "
                f"the run's workers opens it: put it on storage every node mounts at the same path{hint}"
            )
    return len(nodes)
