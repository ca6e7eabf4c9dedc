"""What every process of the CPU harness runs before any of Arctic's code.

:func:`install` runs in the server process and, as Ray's
``worker_process_setup_hook``, in every Ray worker (DeepSpeed workers, sampling
stand-ins). It does two things:

- ``arctic_inference``: the real pure-Python modules from the unpacked
  arctic-inference sources named by ``ARCTIC_HARNESS_INFERENCE_SRC`` (the model
  config, the weight-sync schedule and sender), with the GPU-only
  ``ReplicaPool`` taken from stand_ins/ instead. The packages are created
  without running their ``__init__``, which imports vLLM.
- CUDA device calls with no CPU meaning: Arctic's DeepSpeed worker asks for the
  current device and its UUID to log them (``initialize``), and after moving
  its state between devices it synchronizes and reads the allocated memory to
  report it (``offload_to_cpu`` and the other sleep/wake calls). On a CPU build
  of torch each raises; here they answer as an idle device would (device 0,
  nothing to wait for, 0 bytes). DeepSpeed itself runs on its CPU accelerator
  (``DS_ACCELERATOR=cpu``, gloo).
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from types import SimpleNamespace

STAND_INS = Path(__file__).resolve().parent / "stand_ins"
PACKAGES = ("arctic_inference", "arctic_inference.server", "arctic_inference.server.weight_sync")


def install() -> None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    real_root = Path(os.environ["ARCTIC_HARNESS_INFERENCE_SRC"])
    for name in PACKAGES:
        if name in sys.modules:
            continue
        rel = Path(*name.split("."))
        module = types.ModuleType(name)
        module.__path__ = [str(p) for p in (STAND_INS / rel, real_root / rel) if p.is_dir()]
        sys.modules[name] = module

    import torch

    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
        torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(  # type: ignore[assignment]
            name="cpu", uuid="cpu", total_memory=0
        )
        torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]
        torch.cuda.memory_allocated = lambda device=None: 0  # type: ignore[assignment]
