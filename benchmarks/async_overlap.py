"""Overlapped runs (``trainer.v1.trainer_mode=remote_async``) beside synchronous ones, on each backend.

For each backend, the demo is trained with the same settings in each mode (:data:`MODES`: synchronous,
overlapped, and overlapped with the weight sync beside the next step where the backend declares it), ``--seeds``
runs each (the seed goes to verl's data order and the backend's own seed), and the table gives, per mode, the
mean step time (steps 2 on: the first step of an overlapped run has nothing sampled ahead; over the seeds), its
speed-up over the synchronous runs, the mean reward of the last 3 steps with its spread over the seeds, and
verl's trajectory_staleness/max over every step (its largest and its mean). With ``--latency S`` every HTTP
request to the service first waits S seconds in a proxy, as a hosted service's network and queue add: what
overlap exists to hide. The local backend is a Ray actor, not reached over HTTP: it is measured without latency only.

    python benchmarks/async_overlap.py [--backends local,arctic,tinker] [--steps 10] [--seeds 0,1]
                                       [--latency 0,1.5] [--modes remote,remote_async,remote_async+bg]

Arctic runs against verl-arctic's test server (its engines on separate devices: ``remote_backend.colocate=false``)
and Tinker against SkyRL's Tinker server (``verl_remote_tinker.testing.local_server``, whose environment is
built on first use; ``remote_backend.snapshot_sampling=true``, as its sampler is no snapshot); each is started
once and shared by its runs. Needs verl-arctic and verl-remote-tinker
installed. Every run's log stays under ``--workdir`` (default: a new temporary folder).
"""

from __future__ import annotations

import argparse
import http.client
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}
#: What each mode of the table adds to a run. ``remote_async+bg``: overlapped, with the weight sync beside the next
#: step (``trainer.v1.remote_async.background_weight_sync=true``), for backends that declare it (verl-arctic); a
#: step may then train on samples two updates old.
SYNC_BESIDE = "trainer.v1.remote_async.background_weight_sync=true"
MODES = {
    "remote": ["trainer.v1.trainer_mode=remote"],
    "remote_async": ["trainer.v1.trainer_mode=remote_async"],
    "remote_async+bg": ["trainer.v1.trainer_mode=remote_async", SYNC_BESIDE],
}


class DelayingProxy(ThreadingHTTPServer):
    """Forwards every request to ``upstream`` after ``delay_s`` seconds; requests wait side by side (a latency,
    not a throughput limit)."""

    daemon_threads = True
    request_queue_size = 1024  # a step's requests arrive at once (the default backlog of 5 resets the rest)

    def __init__(self, upstream: str, delay_s: float) -> None:
        self.upstream = urlsplit(upstream)
        self.delay_s = delay_s
        super().__init__(("127.0.0.1", 0), _Forward)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()


class _Forward(BaseHTTPRequestHandler):
    server: DelayingProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        return

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        time.sleep(self.server.delay_s)
        upstream = self.server.upstream
        conn = http.client.HTTPConnection(upstream.hostname or "127.0.0.1", upstream.port, timeout=600)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
        except OSError as exc:  # the service dropped the connection (at a run's end, say): as a gateway says it
            self.send_error(502, f"upstream: {exc}")
            return
        finally:
            conn.close()
        try:
            self.send_response(answer.status)
            for key, value in answer.getheaders():
                if key.lower() not in HOP_BY_HOP:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client left first (a run's end): nobody to answer
            self.close_connection = True

    do_GET = do_POST = do_PUT = do_DELETE = _forward


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def arctic_server(workdir: Path) -> Iterator[str]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with (workdir / "arctic-server.log").open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "verl_arctic.testing.server", "--port", str(port), "--api", "main"],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2).read()
                break
            except OSError as exc:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the Arctic test server did not start: {workdir / 'arctic-server.log'}"
                    ) from exc
                time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


@contextmanager
def tinker_server(workdir: Path) -> Iterator[str]:
    from verl_remote_tinker.testing.local_server import start_local_server

    with start_local_server(workdir=workdir / "tinker-server") as server:
        yield server.url


SERVICES = {"arctic": arctic_server, "tinker": tinker_server}


def backend_overrides(backend: str, url: str | None) -> list[str]:
    if backend == "local":
        return ["remote_backend=local"]
    if backend == "arctic":
        return ["remote_backend=arctic", f"remote_backend.comms.url={url}", "remote_backend.comms.api=main",
                "remote_backend.colocate=false"]  # fmt: skip
    # SkyRL's server samples from the adapter it trains (the backend declines overlapped runs there by default):
    # taken for a snapshot service, as hosted Tinker is, the overlapped runs have hosted Tinker's timing and
    # fresher samples than their staleness tags say.
    return ["--recipe", str(ROOT / "configs" / "tinker-local-server.yaml"), f"remote_backend.base_url={url}",
            "remote_backend.snapshot_sampling=true"]  # fmt: skip


def syncs_beside(backend: str) -> bool:
    """Whether the backend's class declares RemoteBackend.background_weight_sync (the others sync between steps
    whatever the run asks: a ``+bg`` mode would measure ``remote_async`` again)."""
    from verl_remote.discovery.registry import load_backend_class

    return bool(load_backend_class(backend).background_weight_sync)


def seed_overrides(backend: str, seed: int) -> list[str]:
    own = {"local": "remote_backend.seed", "arctic": None, "tinker": "remote_backend.lora_seed"}[backend]
    return [f"data.seed={seed}"] + ([f"{own}={seed}"] if own else [])


def metric(text: str, name: str) -> list[float]:
    return [float(part.split(":", 1)[1]) for part in text.split() if part.startswith(f"{name}:")]


def train(folder: Path, overrides: list[str]) -> tuple[list[float], list[float], list[float]]:
    """One run; its step times, rewards and staleness (verl's trajectory_staleness/max), from verl's metrics lines
    in the run's log."""
    folder.mkdir(parents=True)
    cli = "from verl_remote.cli.main import console_main; console_main()"
    quick = ["trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.save_freq=-1"]
    quick.append("+ray_kwargs.ray_init.include_dashboard=false")
    command = [sys.executable, "-c", cli, "train", *overrides, f"trainer.default_local_dir={folder / 'ckpt'}", *quick]
    done = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=3600, check=False)
    (folder / "console.txt").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"run in {folder} failed ({done.returncode}): {done.stderr.strip().splitlines()[-1:]}")
    log = sorted((folder / "ckpt" / "logs").glob("train-*.log"))[-1].read_text()
    staleness = metric(log, "training/off_policy/trajectory_staleness/max")
    return metric(log, "timing_s/step"), metric(log, "critic/score/mean"), staleness


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the services it started stop on the way out
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="local,arctic,tinker")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--latency", default="0,1.5", help="seconds added to each HTTP request, comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help="modes to run, comma-separated: " + ", ".join(MODES))
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="async-overlap-"))
    workdir.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    latencies = [float(x) for x in args.latency.split(",")]
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"--modes: no mode {sorted(unknown)}; the modes: {', '.join(MODES)}")
    print(f"runs of {args.steps} steps, seeds {seeds}; logs under {workdir}", flush=True)
    rows = []
    for backend in args.backends.split(","):
        service = SERVICES.get(backend)
        with service(workdir) if service else _nothing() as url:
            for latency in latencies if service else [0.0]:
                proxy = DelayingProxy(url, latency) if service and latency > 0 else None
                try:
                    target = proxy.url if proxy else url
                    result = {
                        mode: measure(backend, target, latency, mode, seeds, args.steps, workdir)
                        for mode in modes
                        if SYNC_BESIDE not in MODES[mode] or syncs_beside(backend)
                    }
                finally:
                    if proxy:
                        proxy.close()
                rows.append((backend, latency, result))
    print()
    print("| backend | latency per request | mode | s/step | speed-up | last-3 reward (spread) | staleness max, mean |")
    print("|---|---|---|---|---|---|---|")
    for backend, latency, result in rows:
        base = statistics.fmean(result["remote"][0]) if "remote" in result else None
        for mode, (times, rewards, staleness) in result.items():
            step_s = statistics.fmean(times)
            speed_up = f"{base / step_s:.2f}x" if base else "-"
            print(f"| {backend} | {latency:g} s | {mode} | {step_s:.2f} | {speed_up} "
                  f"| {statistics.fmean(rewards):.3f} ({min(rewards):.3f}-{max(rewards):.3f}) "
                  f"| {max(staleness):g}, {statistics.fmean(staleness):.2f} |")  # fmt: skip


def measure(
    backend: str, url: str | None, latency: float, mode: str, seeds: list[int], steps: int, workdir: Path
) -> tuple[list[float], list[float], list[float]]:
    """Runs of one mode, one per seed: each run's mean step time from step 2 (its steps may alternate between
    short and long ones, so the mean, not the median, is what the run's length says), last-3 mean reward, and
    the staleness of every step of every run (verl's trajectory_staleness/max)."""
    times, rewards, staleness = [], [], []
    for seed in seeds:
        folder = workdir / f"{backend}-{latency:g}s-{mode}-{seed}"
        overrides = [*backend_overrides(backend, url), *seed_overrides(backend, seed), *MODES[mode]]
        step_s, reward, stale = train(folder, [*overrides, f"trainer.total_training_steps={steps}"])
        times.append(statistics.fmean(step_s[1:]))
        rewards.append(statistics.fmean(reward[-3:]))
        staleness.extend(stale)
        print(
            f"  {folder.name}: {times[-1]:.2f} s/step, last-3 reward {rewards[-1]:.3f}, staleness max {max(stale):g}",
            flush=True,
        )
    return times, rewards, staleness


@contextmanager
def _nothing() -> Iterator[None]:
    yield None


if __name__ == "__main__":
    main()
