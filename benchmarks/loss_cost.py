"""What a policy loss costs per step on each backend: the demo's update time under verl's vanilla loss beside
another policy loss.

On the local backend every loss is verl's own on the model (the same work whatever the mode); on verl-arctic the
vanilla loss at Arctic's clip ratios is one pass through Arctic's ``verl_grpo``, any other loss one more forward
pass per mini-batch (verl's gradient carried through ``verl_grpo``: src/verl_arctic/loss.py). Each run is the
demo (8 x 8 samples a step) on the Arctic test server (generation main, a process of its own) or the local
backend; the figures are medians over the steps after the first of verl's own ``timing_s/update_actor`` and
``timing_s/step``, from each run's log.

    python benchmarks/loss_cost.py [--steps 8] [--losses vanilla,gspo] [--backends local,arctic]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

BIN = Path(sys.executable).parent
QUICK = ["trainer.val_before_train=false", "trainer.test_freq=-1", "+ray_kwargs.ray_init.include_dashboard=false"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def arctic_server(folder: Path) -> Iterator[str]:
    """The Arctic test server (main, separate engines as a run overlapping would have, one training rank)."""
    port = _free_port()
    log = (folder / "arctic-server.log").open("w")
    server = subprocess.Popen(
        [sys.executable, "-m", "verl_arctic.testing.server", "--port", str(port), "--api", "main"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Arctic test server did not start: {folder / 'arctic-server.log'}")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)


def metric(log: str, key: str) -> list[float]:
    return [float(v) for v in re.findall(rf"\b{re.escape(key)}:([-\d.e]+)", log)]


def run(folder: Path, backend: list[str], loss: str, steps: int) -> dict[str, float]:
    ckpt = folder / f"ckpt-{loss}-{len(list(folder.iterdir()))}"
    command = [
        str(BIN / "verl-remote"), "train", *backend, *QUICK, f"trainer.total_training_steps={steps}",
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss}", f"trainer.default_local_dir={ckpt}",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=folder, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{out.stderr[-3000:]}")
    [log] = (ckpt / "logs").glob("train-*.log")
    text = log.read_text()
    update, step = metric(text, "timing_s/update_actor")[1:], metric(text, "timing_s/step")[1:]
    return {"update_s": statistics.median(update), "step_s": statistics.median(step)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--losses", default="vanilla,gspo")
    parser.add_argument("--backends", default="local,arctic")
    args = parser.parse_args()
    losses = args.losses.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="loss-cost-") as tmp:
        folder = Path(tmp)
        for backend in args.backends.split(","):
            with contextlib.ExitStack() as stack:
                settings = ["remote_backend=local"]
                if backend == "arctic":
                    url = stack.enter_context(arctic_server(folder))
                    settings = ["remote_backend=arctic", f"remote_backend.comms.url={url}"]
                for loss in losses:
                    figures = run(folder, settings, loss, args.steps)
                    rows.append({"backend": backend, "loss": loss, **figures})
                    print(json.dumps(rows[-1]), flush=True)
    print()
    print("| backend | policy loss | update (median s) | step (median s) |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['backend']} | {row['loss']} | {row['update_s']:.2f} | {row['step_s']:.2f} |")


if __name__ == "__main__":
    main()
