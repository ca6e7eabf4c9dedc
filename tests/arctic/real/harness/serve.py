"""Serve Arctic's real RL HTTP server application on CPU (runs in the Arctic environment, not verl's).

    python serve.py --generation v0.1 --port 7000 --arctic-inference /path/to/arctic_inference-0.2.0 \
        [--training-gpus 1] [--log-prob-gpus 1] [--sampling-gpus 1]
    python serve.py --generation main --port 7000 --arctic-inference /path/to/arctic_inference-0.3.0 ...

What runs is Arctic's own code from the installed arctic-platform: the FastAPI
app and every route handler, the pydantic request models, the body codec
(``torch.save`` for v0.1, DSSST1 safetensors for main), the batch split across
data-parallel ranks and the merges of their answers, the DeepSpeed worker
actors (DeepSpeed on its CPU accelerator, gloo instead of NCCL) with their
micro-batch loop, the verl_grpo loss pipeline, checkpoint save/load, and for
main the colocation placement groups and the CPU-file weight sync. Stood in
for, because they need GPUs: arctic_inference's vLLM ``ReplicaPool``
(stand_ins/), the two CUDA device queries the worker logs (boot.py), and the
"GPUs" Ray schedules the workers on (logical resources of a local Ray cluster).

This replaces only Arctic's ``main()`` (argument parsing, starting Ray); the
app state below is what that ``main()`` sets:

- v0.1 (arctic-platform 0.1.2, ``rl/http_server.py``): ``colocate`` off, so
  weight syncs take the CPU-file path when the client asks for a colocated sync
  (colocation is a per-call body field there).
- main (arctic-platform 0.1.4, ``common/http_server.py``): launched as with
  ``--colocate``, Arctic's documented set-up. Colocation is a server-launch
  property in main, and the only weight-sync path that needs no GPU (the CPU
  file, taken when the job's ``cuda_ipc`` is false) exists only in colocated
  mode; without it every sync would go through NCCL. Arctic's own
  ``create_colocate_placement`` builds the placement group over the logical
  GPUs, and the training, sampling and log-prob actors are pinned to its
  bundles with Arctic's fractional GPU claims.

The training and log-prob ranks rendezvous on ``MASTER_PORT`` (Arctic's
default 29500/29501 when it is unset); set it in the environment to run two
servers with training jobs at once. Arctic 0.1.4 reads the same variable for
both job types, so with it set only one of them can run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--generation", choices=["v0.1", "main"], required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--arctic-inference", type=Path, required=True, help="unpacked arctic-inference sources")
    parser.add_argument("--training-gpus", type=int, default=1)
    parser.add_argument("--sampling-gpus", type=int, default=1)
    parser.add_argument("--log-prob-gpus", type=int, default=1)
    args = parser.parse_args()

    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["ARCTIC_HARNESS_INFERENCE_SRC"] = str(args.arctic_inference.resolve())
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(HERE))

    import boot

    boot.install()

    import ray

    if args.generation == "v0.1":
        # Not colocated: every engine has GPUs of its own (the stand-in sampler asks for none).
        gpus = args.training_gpus + args.sampling_gpus + args.log_prob_gpus
        cpus = max(2, gpus * 2)
    else:
        from arctic_platform.common.utils.ray_pg import DEFAULT_BUNDLE_RESOURCES

        # One logical GPU per colocation bundle; each bundle also reserves Arctic's CPUs.
        gpus = max(args.training_gpus, args.sampling_gpus, args.log_prob_gpus, 1)
        cpus = gpus * int(DEFAULT_BUNDLE_RESOURCES["CPU"]) + 2
    ray.init(
        address="local",
        num_cpus=cpus,
        num_gpus=gpus,
        include_dashboard=False,
        log_to_driver=True,
        runtime_env={
            "env_vars": {
                name: os.environ[name] for name in ("DS_ACCELERATOR", "ARCTIC_HARNESS_INFERENCE_SRC", "PYTHONPATH")
            },
            "worker_process_setup_hook": "boot.install",
        },
    )

    import uvicorn

    app = _v01_app(args) if args.generation == "v0.1" else _main_app(args)
    try:
        uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    finally:
        ray.shutdown()
    return 0


def _v01_app(args: argparse.Namespace) -> Any:
    from arctic_inference.server.replica_pool import ReplicaPool
    from arctic_platform.rl import http_server
    from arctic_platform.rl.utils.ray_pg import ColocatePlacement

    app = http_server.app
    # What Arctic's main() sets (rl/http_server.py:1065-1105 in 0.1.2), without colocation.
    app.state.training_gpus = args.training_gpus
    app.state.sampling_gpus = args.sampling_gpus
    app.state.log_prob_gpus = args.log_prob_gpus
    app.state.log_prob_engine = "deepspeed"
    app.state.colocate = False
    app.state.placement = ColocatePlacement()
    app.state.placement_group = None
    app.state.n_bundles = 0
    app.state.training_workers = []
    app.state.sampling_pool = ReplicaPool()
    app.state.log_prob_pool = None
    app.state.log_prob_workers = []
    app.state.log_prob_tokenizer = None
    app.state.jobs = {}
    app.state.next_job_id = 1
    app.state.weight_sync_ready = False
    app.state.weight_sync_bucket_size = 256 * 1024 * 1024
    return app


def _main_app(args: argparse.Namespace) -> Any:
    from arctic_inference.server.replica_pool import ReplicaPool
    from arctic_platform.common import http_server
    from arctic_platform.common.utils.ray_pg import create_colocate_placement

    app = http_server.app
    # What Arctic's main() sets (common/http_server.py:1043-1085 in 0.1.4) for
    # `--colocate` and the default `--log-prob-engine vllm`. The pools are created
    # directly, not through http_server._replica_pool_cls(): its dependency gate
    # asks for an installed arctic-inference distribution (with vLLM), which this
    # environment stands in for.
    app.state.training_gpus = args.training_gpus
    app.state.sampling_gpus = args.sampling_gpus
    app.state.log_prob_gpus = args.log_prob_gpus
    app.state.log_prob_engine = "vllm"
    app.state.colocate = True
    n_bundles = max(args.training_gpus, args.sampling_gpus, args.log_prob_gpus)
    app.state.placement = create_colocate_placement(n_bundles)
    app.state.n_bundles = app.state.placement.n_bundles
    groups = app.state.placement.placement_groups
    app.state.placement_group = groups[0] if len(groups) == 1 else None
    app.state.training_workers = []
    app.state.sampling_pool = ReplicaPool() if args.sampling_gpus > 0 else None
    app.state.log_prob_pool = ReplicaPool() if args.log_prob_gpus > 0 else None
    app.state.log_prob_workers = []
    app.state.log_prob_tokenizer = None
    app.state.jobs = {}
    app.state.next_job_id = 1
    app.state.weight_sync_ready = False
    app.state.weight_sync_bucket_size = http_server._WEIGHT_SYNC_BUCKET_SIZE
    return app


if __name__ == "__main__":
    raise SystemExit(main())
